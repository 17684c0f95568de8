import os
import time
import uuid

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
    """Fail the run when a process a test started outlives the session (then stop it)."""
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
