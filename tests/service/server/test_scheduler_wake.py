"""The server loop woken by a runner's exit: a queued job starts as soon as the runner of the job
ahead of it exits, not at the loop's next poll. Real runners (``job_main`` processes started by
:class:`~service.server.runners.LocalProcessRunners`), a real SQLite store, the scheduler's own thread."""

from __future__ import annotations

import time

import pytest

from service.server.runners import LocalProcessRunners
from service.server.scheduler import Scheduler, StaticCluster
from service.server.store import JobStore, sqlite_url
from service.spec.spec import parse_spec
from tests.helpers.server import tiny

pytestmark = pytest.mark.procs


def test_a_queued_job_starts_when_the_runner_ahead_of_it_exits_not_at_the_next_poll(tmp_path):
    store = JobStore(sqlite_url(tmp_path))
    runners = LocalProcessRunners(tmp_path, sqlite_url(tmp_path))
    # A poll far longer than the test: only a wake can move the queue (a submit wakes it, and a
    # runner's exit must).
    sched = Scheduler(store, runners, StaticCluster(1, 1), poll_s=600.0)
    try:
        sched.start()
        first = sched.submit(parse_spec(tiny("first", world=1, iters=1)))["id"]
        second = sched.submit(parse_spec(tiny("second", world=1, iters=1)))["id"]  # the one slot is taken
        deadline = time.monotonic() + 60
        while store.get_job(second)["state"] not in ("SUCCEEDED", "FAILED") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [store.get_job(j)["state"] for j in (first, second)] == ["SUCCEEDED", "SUCCEEDED"]
        ended = store.events(first, kind="state")[-1]["time"]  # the runner's last record, just before it exits
        admitted = store.events(second, kind="admission")[0]["time"]
        # mutation: no on_exit wake -> the second job waits for the 600 s poll (the loop above times out)
        assert 0 <= admitted - ended < 10, (ended, admitted)
    finally:
        sched.stop()
        for job_id in list(runners._procs):
            runners.cancel(job_id)
        store.close()
