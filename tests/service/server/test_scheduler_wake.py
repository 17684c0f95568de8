"""The server loop woken by a runner's exit: a job whose runner was killed gets a new runner as soon
as the short exit grace has passed, and a queued job starts as soon as the runner of the job ahead
of it exits, neither at the loop's next poll. Real runners (``job_main`` processes started by
:class:`~service.server.runners.LocalProcessRunners`), a real SQLite store, the scheduler's own thread."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from service.server.runners import LocalProcessRunners
from service.server.scheduler import Scheduler, StaticCluster
from service.server.store import JobStore, sqlite_url
from service.spec.spec import parse_spec
from tests.helpers.server import tiny

pytestmark = pytest.mark.procs


def test_a_killed_runner_is_replaced_and_a_queued_job_starts_when_the_runner_ahead_exits_not_at_the_next_poll(
        tmp_path):
    store = JobStore(sqlite_url(tmp_path))
    runners = LocalProcessRunners(tmp_path, sqlite_url(tmp_path))
    # A poll far longer than the test: only a wake can move anything (a submit wakes the loop; a
    # runner's exit and the end of its exit grace must).
    sched = Scheduler(store, runners, StaticCluster(1, 1), poll_s=600.0)
    try:
        sched.start()
        first = sched.submit(parse_spec(tiny("first", world=1, iters=1)))["id"]
        second = sched.submit(parse_spec(tiny("second", world=1, iters=1)))["id"]  # the one slot is taken
        record = tmp_path / "jobs" / first / "runner.json"
        deadline = time.monotonic() + 30
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(json.loads(record.read_text())["pid"], signal.SIGKILL)  # its first runner, still starting
        killed = time.time()
        deadline = time.monotonic() + 60
        while store.get_job(second)["state"] not in ("SUCCEEDED", "FAILED") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [store.get_job(j)["state"] for j in (first, second)] == ["SUCCEEDED", "SUCCEEDED"]
        (replaced,) = store.events(first, kind="runner")
        # mutation: no wake at the end of the exit grace (or none on the exit) -> no second runner
        # before the 600 s poll (the loop above times out)
        assert replaced["data"]["reason"] == "runner_exited" and 0 <= replaced["time"] - killed < 10, replaced
        ended = store.events(first, kind="state")[-1]["time"]  # the runner's last record, just before it exits
        admitted = store.events(second, kind="admission")[0]["time"]
        # mutation: no on_exit wake -> the second job waits for the 600 s poll
        assert 0 <= admitted - ended < 10, (ended, admitted)
    finally:
        sched.stop()
        for job_id in list(runners._procs):
            runners.cancel(job_id)
        store.close()
