"""When a job whose runner is gone gets a new runner: its restarts and runners so far against ``fault_tolerance.max_restarts``.

The new runner replays the job's events into its controller, which counts the lost attempt as a
restart; a runner that died before recording anything starts the job afresh. Each new runner is
also counted (its ``"runner"`` event), so a runner that keeps dying before it records a restart
still ends the job. :class:`service.server.scheduler.Scheduler` asks this for every lost runner.
"""

from __future__ import annotations

import time

from service.control.events import JobEvent
from service.control.record import count_restarts
from service.server.store import JobStore
from service.spec.stored import stored_section


def max_restarts(row: dict) -> int:
    """The job's ``fault_tolerance.max_restarts``."""
    return stored_section(row.get("spec"), "fault_tolerance").max_restarts


def new_runner_event(store: JobStore, row: dict, code: str, why: str) -> dict | str:
    """The ``"runner"`` event that records a new runner for the job of ``row`` (its runner was lost
    for ``why``, ``code``), or, when the job's restarts are spent, the message it fails with."""
    job_id = row["id"]
    limit = max_restarts(row)
    restarts = count_restarts(JobEvent.from_dict(e) for e in store.events(job_id, kind="state"))
    started = len(store.events(job_id, kind="runner"))
    if max(restarts, started) >= limit:
        return f"{why}, and its fault_tolerance.max_restarts ({limit}) are spent (see the job's logs)"
    return {"time": time.time(), "kind": "runner", "state": row["state"],
            "message": f"{why}: starting runner {started + 2}, which goes on from the job's record",
            "data": {"reason": code}}
