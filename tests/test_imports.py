"""Rooms import one way, downward: api/cli -> api/rest -> service/server -> service/ranks ->
service/control -> service/spec -> workers/rank -> workers/train -> workers/hf ->
workers/checkpoint -> workers/data -> workers/model -> workers/parallel -> workers (the
torch-free vocabulary at its top level: config, grid, routing).

Every module's imports are read from its source (AST), including imports inside functions,
so a backward edge cannot hide behind a lazy import. An import from a lower room into a higher
one (workers -> anything in service, service/spec -> service/control, service/ranks ->
service/server, service -> api, ...) or a cycle between modules fails the test, naming the
modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT
# Each room and its height; a module may import only from its own room or lower ones.
WORKERS_ROOMS = ("workers", "workers.parallel", "workers.model", "workers.data", "workers.checkpoint", "workers.hf",
                 "workers.train", "workers.rank")
SERVICE_ROOMS = ("service.spec", "service.control", "service.ranks", "service.server")
API_ROOMS = ("api.rest", "api.cli")
ROOMS = {room: height for height, room in enumerate(WORKERS_ROOMS + SERVICE_ROOMS + API_ROOMS)}
ROOMS["service"] = ROOMS["service.spec"]
ROOMS["api"] = ROOMS["api.rest"]
PACKAGES = ("api", "service", "workers")


def room_of(module: str) -> int:
    """The height of the innermost room holding ``module`` (``service.ranks.gather`` -> 3)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ROOMS:
            return ROOMS[".".join(parts[:n])]
    raise KeyError(module)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules ``path`` imports anywhere in its body (``from a import b`` names a.b if it is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # "workers.parallel.comm.x" -> the module that holds it
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(p, set(modules)) - {m} for m, p in modules.items()}


def backward_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if room_of(b) > room_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan). A package's
    ``__init__`` importing nothing, a submodule importing its package is no cycle."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_rooms_import_one_way():
    graph = import_graph()
    assert {"api.cli.main", "service.control.controller", "service.spec.spec", "service.ranks.ray_launcher",
            "service.server.scheduler", "workers.train.trainer"} <= set(graph)  # the walk found the code
    assert backward_edges(graph) == []


def test_workers_and_api_hold_only_their_rooms():
    """workers/ keeps only its torch-free vocabulary at the top; api/ only its two programs."""
    loose = sorted(p.name for p in (ROOT / "workers").glob("*.py") if p.name != "__init__.py")
    assert loose == ["config.py", "grid.py", "routing.py"]
    assert {p.name for p in (ROOT / "workers").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        r.split(".")[1] for r in WORKERS_ROOMS[1:]}
    assert sorted(p.name for p in (ROOT / "api").glob("*.py")) == ["__init__.py"]
    assert {p.name for p in (ROOT / "api").iterdir() if p.is_dir() and p.name != "__pycache__"} == {"rest", "cli"}


def test_no_project_module_imports_the_tests():
    graph = {m: imports_of(p, set(project_modules()) | _test_modules()) for m, p in project_modules().items()}
    assert sorted((m, t) for m, targets in graph.items() for t in targets if t.startswith("tests")) == []


def _test_modules() -> set[str]:
    return {module_name(p) for p in (ROOT / "tests").rglob("*.py")}


def test_service_holds_only_its_rooms():
    """Every module of service/ lives in one of its four rooms."""
    loose = sorted(p.name for p in (ROOT / "service").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    assert {p.name for p in (ROOT / "service").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "spec", "control", "ranks", "server"}


# Cycles (each through a function-level import) in modules that other issues own, found when main
# was merged: listed so that every *new* cycle fails, and so that fixing one fails until it is
# removed from here. Not a place to add cycles: break them (move the shared piece down a module).
KNOWN_CYCLES: list[list[str]] = []  # none; a cycle is fixed, not listed


def test_no_import_cycles():
    found = sorted(cycles(import_graph()))
    assert [c for c in found if c not in KNOWN_CYCLES] == [], "new import cycle"
    assert [c for c in KNOWN_CYCLES if c not in found] == [], "a known cycle is gone: remove it from KNOWN_CYCLES"


def test_the_checks_catch_what_they_claim():
    """The detectors themselves, on small graphs: a function-level backward import and a cycle."""
    assert backward_edges({"workers.x": {"service.y"}, "service.y": set()}) == [("workers.x", "service.y")]
    assert backward_edges({"service.y": {"api.z"}, "api.z": {"service.y"}}) == [("service.y", "api.z")]
    assert backward_edges({"service.spec.a": {"service.control.b"}, "service.control.b": set()}) == [
        ("service.spec.a", "service.control.b")]
    assert backward_edges({"service.ranks.a": {"service.server.b"}, "service.server.b": {"service.ranks.a"}}) == [
        ("service.ranks.a", "service.server.b")]
    assert backward_edges({"workers.checkpoint.a": {"workers.hf.b"}, "workers.hf.b": set()}) == [
        ("workers.checkpoint.a", "workers.hf.b")]
    assert backward_edges({"api.rest.a": {"api.cli.b"}, "api.cli.b": set()}) == [("api.rest.a", "api.cli.b")]
    assert cycles({"service.a": {"service.b"}, "service.b": {"service.a"}, "service.c": set()}) == [
        ["service.a", "service.b"]]


def test_function_level_imports_count(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from api.cli.main import main\n    import service.control.jobs\n")
    assert imports_of(src, {"api.cli.main", "service.control.jobs", "api"}) == {"api.cli.main", "service.control.jobs"}


def test_service_never_prints():
    printing = []
    for module, path in project_modules().items():
        if module.startswith("service"):
            tree = ast.parse(path.read_text())
            printing += [f"{module}:{n.lineno}" for n in ast.walk(tree)
                         if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"]
    assert printing == [], "service/ prints; emit an event or return a note instead"
