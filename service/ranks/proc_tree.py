"""Processes this process started, found and reaped through Linux ``/proc`` (empty elsewhere).

Ray's shutdown stops the GCS, raylets and dashboard, but some of their helpers notice only
later; :func:`reap` makes sure that nothing a session started outlives it.
"""

from __future__ import annotations

import glob
import os
import signal
import time


def children(pid: int) -> set[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    out = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            out.update(int(c) for c in open(path).read().split())
        except OSError:
            pass
    return out


def descendants(roots: set[int]) -> set[int]:
    seen, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children(pid))
    return seen


def matching(match) -> list[int]:
    """Pids of the processes whose argv (a list of strings) ``match`` accepts (Linux /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and match(argv):
            out.append(int(pid))
    return out


def marked(name: str, value: str) -> set[int]:
    """Processes whose environment holds ``name=value`` (Linux /proc; empty elsewhere), this one
    excluded. A mark set in the environment of the processes a session starts is inherited by
    everything they start in turn, so it finds them all, also those whose parent died (the agents
    of a killed raylet, orphaned to init)."""
    needle = f"{name}={value}".encode()
    out = set()
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.add(int(path.split("/")[2]))
        except OSError:
            pass
    out.discard(os.getpid())
    return out


def started_at(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None when it is gone)."""
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def orphans(titles: tuple[str, ...], since: int) -> set[int]:
    """Processes adopted by init (their parent died) whose title starts with one of ``titles`` and
    that started at or after ``since`` (clock ticks since boot). Ray's agents rewrite their title
    and with it the environment /proc shows, so a mark cannot find them once their raylet is gone."""
    out = set()
    for path in glob.glob("/proc/[0-9]*/stat"):
        pid = int(path.split("/")[2])
        try:
            fields = open(path).read().rsplit(")", 1)[1].split()
            title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[1] == "1" and int(fields[19]) >= since and title.startswith(titles):
            out.add(pid)
    return out


def reap(pids: set[int], timeout_s: float = 10.0) -> None:
    """Wait for processes this session started to exit, then kill the stragglers by pid.

    Ray's shutdown stops the GCS, raylets and dashboard, but the dashboard's module
    subprocesses notice only later and meanwhile keep writing into the session folder.
    """
    deadline = time.monotonic() + timeout_s
    alive = {p for p in pids if os.path.exists(f"/proc/{p}")}
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {p for p in alive if os.path.exists(f"/proc/{p}") and not is_zombie(p)}
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def is_zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
