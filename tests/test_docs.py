"""The README and docs/ stay true: their links and file paths resolve, every CLI flag they show is
one the CLI accepts, the generated references match the code, and docs/architecture.md names every
module. Pure file reading and argparse: no process starts."""

from __future__ import annotations

import argparse
import glob
import re
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

README_MAX_LINES = 200
TOP_FOLDERS = ("api", "service", "workers", "tests", "bench", "docs", "examples", "deploy", "scripts", ".ci")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# a repository path: a top-level folder, then path characters, ending in a file name or a slash
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*[\w*/])" % "|".join(re.escape(f) for f in TOP_FOLDERS))
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def broken_links(text: str, where: Path) -> list[str]:
    """Relative links and images of a markdown text whose target does not exist."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (where.parent / path).exists():
            out.append(target)
    return out


def missing_paths(text: str) -> list[str]:
    """Repository paths a text mentions (``workers/rank/main.py``, ``tests/workers/model/test_*.py``,
    ``api/rest/static/``) that match nothing in the tree."""
    out = []
    for path in PATH.findall(text):
        path = path.rstrip(".")
        if "." not in Path(path).name and not path.endswith("/") and "*" not in path:
            continue  # a bare word after a folder ("service/ranks"): a room named in prose, checked below
        if not glob.glob(str(ROOT / path)):
            out.append(path)
    return sorted(set(out))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_lines(text: str) -> list[str]:
    """Every ``raytron ...`` command a text shows: lines of code blocks (continuations joined) and
    code spans, each cut at a comment."""
    out, block = [], False
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            block = not block
        elif block:
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            out.append(line.split(" #", 1)[0])
        else:
            out += CODE_SPAN.findall(line)
        i += 1
    return [c for c in out if "raytron " in c]


def unknown_flags(text: str, parser: argparse.ArgumentParser) -> list[str]:
    """``raytron CMD [SUB] ... --flag`` in a text where CMD (or CMD SUB) accepts no ``--flag``."""
    commands = _subcommands(parser)
    out = []
    for line in command_lines(text):
        for m in re.finditer(r"raytron ([a-z]+)((?: [a-z]+)?)", line):
            sub = commands.get(m.group(1))
            if sub is None:
                continue
            inner = _subcommands(sub).get(m.group(2).strip()) if m.group(2) else None
            sub = inner or sub
            rest = line[m.end():]
            rest = rest.split("raytron ", 1)[0].split("|", 1)[0] if "|" in rest and "[" not in rest else rest.split(
                "raytron ", 1)[0]
            accepted = set(sub._option_string_actions)
            out += [f"raytron {m.group(1)}: {flag}" for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", rest)
                    if flag not in accepted]
    return sorted(set(out))


def test_the_readme_is_read_in_five_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_every_link_and_path_resolves(doc):
    text = doc.read_text()
    assert broken_links(text, doc) == []
    assert missing_paths(text) == []


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.name)
def test_every_cli_flag_shown_is_accepted(doc):
    from api.cli.main import build_parser

    assert unknown_flags(doc.read_text(), build_parser()) == []


def test_the_checks_catch_what_they_claim(tmp_path):
    from api.cli.main import build_parser

    page = tmp_path / "page.md"
    page.write_text("")
    assert broken_links("[ok](page.md) [gone](nowhere.md) [web](https://x.org) [a](#top)", page) == ["nowhere.md"]
    assert missing_paths("see `workers/rank/main.py` and workers/rank/gone.py, tests/workers/model/test_*.py") == [
        "workers/rank/gone.py"]
    text = "```\nraytron run SPEC --launcher processes \\\n   --no-such-flag  # --comment-flag\n```\n" \
           "and `raytron users add NAME --admin --root`"
    assert unknown_flags(text, build_parser()) == ["raytron run: --no-such-flag", "raytron users: --root"]


def test_the_generated_references_match_the_code():
    from scripts import cli_reference, spec_reference

    assert spec_reference.main(["--check"]) == 0, "run python -m scripts.spec_reference"
    assert cli_reference.main(["--check"]) == 0, "run python -m scripts.cli_reference"


def test_the_architecture_page_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(str(p.relative_to(ROOT)) for package in ("api", "service", "workers")
                     for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in text] == []


CONFLICT = re.compile(r"^(<{7}|>{7}) ", re.M)


def conflict_markers(text: str) -> list[int]:
    """Line numbers of a merge's conflict markers left in ``text``."""
    return [text.count("\n", 0, m.start()) + 1 for m in CONFLICT.finditer(text)]


def test_no_merge_conflict_is_left_in_a_tracked_file():
    left = {}
    paths = [ROOT / n for n in ("README.md", "Makefile", "pyproject.toml")]
    paths += [p for top in TOP_FOLDERS for p in (ROOT / top).rglob("*") if ".venv" not in p.parts]
    for path in paths:
        if path.suffix in {".py", ".md", ".js", ".css", ".html", ".toml", ".yaml", ".yml", ".txt", ""} and path.is_file():
            if lines := conflict_markers(path.read_text(errors="replace")):
                left[str(path.relative_to(ROOT))] = lines
    assert not left, f"merge conflict markers left in: {left}"
    assert conflict_markers("a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> other\n") == [2, 6]
