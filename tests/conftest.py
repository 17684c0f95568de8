import contextlib
import json
import os
import time
import uuid

import pytest
import torch

from service.ranks.proc_tree import children, is_zombie, marked

# Ranks run one intra-op thread each on these 2-core machines; the reference runs in this
# process, where a second OpenMP thread only spins against the rank processes.
torch.set_num_threads(1)

# Every process a test starts (servers, runners, ranks, Ray clusters, browsers, and what they start
# in turn) inherits this mark, so the session can tell at its end whether any of them outlived it.
SESSION_MARK = "RAYTRON_TEST_SESSION"
os.environ[SESSION_MARK] = uuid.uuid4().hex
LEFTOVER_WAIT_S = float(os.environ.get("RAYTRON_LEFTOVER_WAIT_S", "15"))  # how long the last ones may take to exit


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def leftovers() -> dict[int, str]:
    """Processes started during this session that are still running, but for this process's own
    multiprocessing helpers (its forkserver and resource tracker end with it)."""
    helpers = {p for p in children(os.getpid())
               if "multiprocessing.forkserver" in _cmdline(p) or "multiprocessing.resource_tracker" in _cmdline(p)}
    return {p: _cmdline(p) for p in marked(SESSION_MARK, os.environ[SESSION_MARK]) - helpers if not is_zombie(p)}


def pytest_sessionfinish(session, exitstatus):
    """Record each test's time (:data:`TIMES_FILE`); fail the run when a process a test started outlives
    the session (then stop it)."""
    _write_times(session)
    deadline = time.monotonic() + LEFTOVER_WAIT_S  # some are on their way out
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"  pid {pid}: {cmd[:200]}" for pid, cmd in sorted(left.items())]
    text = f"{len(left)} process(es) started by the tests outlived them:\n" + "\n".join(lines)
    if reporter is not None:
        reporter.write_line(text, red=True)
    else:
        print(text)
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    session.exitstatus = 1


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory):
    """One real ``mlflow server`` on 127.0.0.1 (SQLite) for the session's tracker tests, started by the
    first that asks: each reads back its own experiment or run ids (job ids are unique), so they share
    it instead of starting one each."""
    from tests.helpers.mlflow_server import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


# ---- tiers: every test's tier is its marker; a fast test (no marker) starts no process ----------------

TIERS = ("gpu", "slow", "ray", "procs")
TIMES_FILE = ".pytest_times.json"  # scripts/test_times.py reads it
_session = {"start": time.time(), "tiers": {}, "seconds": {}}


def tier_of(item) -> str:
    """``gpu``, ``slow``, ``ray`` or ``procs`` (the test's marker, the first of these it has), else ``fast``."""
    return next((t for t in TIERS if item.get_closest_marker(t) is not None), "fast")


class ProcessStarted(AssertionError):
    """A fast test (no tier marker) started a process: it belongs in the procs tier (or deeper)."""


@contextlib.contextmanager
def no_processes(nodeid: str):
    """Within: starting a process (subprocess, fork, multiprocessing) raises :class:`ProcessStarted`."""
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise ProcessStarted(f"{nodeid} starts a process but carries no tier marker: mark it "
                             f"pytest.mark.procs (or slow / ray), so that make test-fast stays process-free")

    patched = [(subprocess.Popen, "_execute_child"), (os, "fork"), (os, "posix_spawn"), (os, "posix_spawnp"),
               (multiprocessing.process.BaseProcess, "start")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def pytest_collection_modifyitems(session, config, items):
    _session["tiers"].update({item.nodeid: tier_of(item) for item in items})


def _guarded(item):
    fast = _session["tiers"].get(item.nodeid, tier_of(item)) == "fast"
    return no_processes(item.nodeid) if fast else contextlib.nullcontext()


# Setup and call only: a session fixture (a PostgreSQL server, say) ends in whichever test runs last.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if _session["tiers"].get(item.nodeid, tier_of(item)) in ("slow", "procs", "ray"):
        # Before any test of the session starts one with a shorter list (tests/helpers/ranks.py).
        from tests.helpers.ranks import start_forkserver

        start_forkserver()
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        yield


def pytest_runtest_logreport(report):
    """Each test's seconds, setup and teardown included (a module fixture's cost lands on its first test)."""
    _session["seconds"][report.nodeid] = _session["seconds"].get(report.nodeid, 0.0) + report.duration


def _write_times(session) -> None:
    tests = {nodeid: {"tier": _session["tiers"].get(nodeid, "fast"), "seconds": round(s, 3)}
             for nodeid, s in _session["seconds"].items()}
    if tests:
        path = session.config.rootpath / TIMES_FILE
        path.write_text(json.dumps({"finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "wall_s": round(time.time() - _session["start"], 1), "tests": tests}, indent=0))
