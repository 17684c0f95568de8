"""How appending one event brings a job's row in step, in the same transaction (see
:mod:`service.server.store`): its state, attempts and error for a ``"state"`` event, its current
iteration, latest loss and metric names and that iteration's metrics row for an ``"iteration"``
event, and for every event ``last_seq`` and ``updated_at``."""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from service.control.events import STATES, TERMINAL_STATES, JobState
from service.server import store_schema
from service.server.store_schema import attempts, events, jobs, metrics


class InvalidTransition(ValueError):
    """A state change the job's state forbids (a terminal state is final)."""


def append_event_row(conn: Connection, job_id: str, row, event: dict, seq: int | None) -> int:
    """Store ``event`` as number ``seq`` (None: the next) of the job whose locked row is ``row``;
    returns its seq. The same event stored again under its seq is a replay (stored once)."""
    current = row.state
    kind, state, data = event.get("kind"), event.get("state"), event.get("data") or {}
    if not isinstance(kind, str) or state not in STATES or not isinstance(event.get("time"), (int, float)):
        raise ValueError(f"an event needs a time, a kind and a state among {', '.join(STATES)}; got {event!r}")
    if seq is None:
        seq = row.last_seq + 1  # the row keeps it (schema v2): no max() over the events
    else:
        if seq < 1:
            raise ValueError(f"event seq starts at 1, got {seq}")
        key = (events.c.job_id == job_id) & (events.c.seq == seq)
        old = conn.execute(sa.select(events.c.time, events.c.kind, events.c.state).where(key)).first()
        if old is not None:
            if tuple(old) == (event["time"], kind, state):
                return seq  # a replay: stored once
            raise ValueError(f"event {seq} of job {job_id} is already a {old.kind!r} event of time {old.time}; "
                             f"number new events from last_seq + 1")
    values: dict = {"updated_at": time.time(), "last_seq": sa.case((jobs.c.last_seq > seq, jobs.c.last_seq), else_=seq)}
    if kind == "state":
        if current in TERMINAL_STATES:
            raise InvalidTransition(f"job {job_id} is {current}, which is final; it cannot become {state}")
        values["state"] = state
        _apply_attempts(conn, job_id, state, event, data)
        if state in (JobState.FAILED.value, JobState.CANCELLED.value):
            values["error"] = data.get("error") or _last_failure(conn, job_id, state) or {
                "code": state.lower(), "message": event.get("message", "")}
    elif kind == "iteration" and isinstance(data.get("iteration"), int):
        values.update(iteration=data["iteration"], loss=store_schema.number(data.get("loss")),
                      tokens_per_s=store_schema.number(data.get("tokens_per_s")))
        names = set(row.metric_names or ())
        if not names.issuperset(k for k in data if k != "iteration"):
            values["metric_names"] = sorted(names.union(k for k in data if k != "iteration"))
        _put_metrics(conn, job_id, data["iteration"], data, row.attempt)
    conn.execute(events.insert().values(job_id=job_id, seq=seq, time=event["time"], kind=kind, state=state,
                                        message=event.get("message", ""), data=data))
    conn.execute(jobs.update().where(jobs.c.id == job_id).values(**values))
    return seq


def _last_failure(conn: Connection, job_id: str, state: str) -> dict | None:
    if state != JobState.FAILED.value:
        return None
    query = (sa.select(events.c.data).where((events.c.job_id == job_id) & (events.c.kind == "failure"))
             .order_by(events.c.seq.desc()).limit(1))
    return conn.execute(query).scalar()


def _apply_attempts(conn: Connection, job_id: str, state: str, event: dict, data: dict) -> None:
    open_ = (attempts.c.job_id == job_id) & attempts.c.ended_at.is_(None)
    if state in (JobState.RESTARTING.value, JobState.STARTING.value) or state in TERMINAL_STATES:
        reason = f"{state}: {event.get('message')}" if event.get("message") else state
        conn.execute(attempts.update().where(open_).values(ended_at=event["time"], reason=reason))
    if state == JobState.STARTING.value:
        last = conn.execute(sa.select(sa.func.max(attempts.c.number)).where(attempts.c.job_id == job_id)).scalar()
        conn.execute(attempts.insert().values(job_id=job_id, number=(last or 0) + 1, started_at=event["time"],
                                              from_checkpoint=data.get("from_checkpoint")))


def _put_metrics(conn: Connection, job_id: str, iteration: int, data: dict, attempt: int | None) -> None:
    key = (metrics.c.job_id == job_id) & (metrics.c.iteration == iteration)
    conn.execute(metrics.delete().where(key))
    conn.execute(metrics.insert().values(job_id=job_id, iteration=iteration, data=data, attempt=attempt))
