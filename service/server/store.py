"""The persistent job store: jobs, every event of their history, attempts and per-iteration metrics.

Events are the record: the one history of a job, which the REST API, its event stream and a
restarted server all read. An event is the dict of
``JobEvent.to_dict()`` (time, kind, state, message, data), numbered 1, 2, ... per job, and
appending one brings the job's row in step in the same transaction, so a controller whose
``on_event`` appends each event before acting on it leaves the whole truth here:

* ``"state"``: the job's state (nothing leaves a terminal state), its attempts (STARTING opens
  attempt n+1, RESTARTING or a terminal state closes it) and, on FAILED or CANCELLED, its error
  (the event's ``data["error"]``, else the last ``"failure"`` event's data);
* ``"iteration"``: the job's current iteration, its latest ``loss`` and ``tokens_per_s`` and the
  names of the metrics it reports (columns of the row, so reading a job never reads its curve),
  and that iteration's metrics row, tagged with the attempt that wrote it (the latest attempt's
  value wins after a restart).

Every event also sets the row's ``last_seq`` and ``updated_at``: together they are the job's
:meth:`JobStore.job_version`, which a reader's cache compares instead of reading the job again.

The database, its connections and write transactions are :mod:`service.server.store_db`; the
schema (tables, version, migrations) :mod:`service.server.store_schema`; what appending an
event does to the job's row, :mod:`service.server.store_events`.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from service.control.events import STATES, TERMINAL_STATES, JobState  # noqa: F401 (part of the store's interface)
from service.server import store_schema
from service.server.store_db import Database
from service.server.store_events import InvalidTransition, append_event_row  # noqa: F401 (InvalidTransition: part of the interface)
from service.server.store_schema import BOOTSTRAP_ADMIN, SchemaError, attempts, events, jobs, metrics  # noqa: F401


class UnknownJob(LookupError):
    """No job with that id (HTTP 404)."""


def sqlite_url(data_dir: str | Path) -> str:
    """The default database: ``raytron.db`` in ``data_dir``."""
    return f"sqlite:///{Path(data_dir).expanduser().resolve() / 'raytron.db'}"


class JobStore(Database):
    """The job store over one database (:class:`~service.server.store_db.Database`); thread-safe, and
    safe to share with other processes.

    Args:
        database_url: a SQLAlchemy URL, e.g. ``sqlite:////var/lib/raytron/raytron.db`` (see
            :func:`sqlite_url`) or ``postgresql+psycopg://user:pw@host/raytron``.
        busy_timeout_s: SQLite only: how long a writer waits for another's lock before failing.

    Raises:
        SchemaError: the database was written by a newer raytron, or is not a raytron database.
        ValueError: an in-memory SQLite URL (each connection would see its own database).
    """

    def __init__(self, database_url: str, *, busy_timeout_s: float = 30.0):
        super().__init__(database_url, busy_timeout_s=busy_timeout_s)
        with self._write() as conn:
            store_schema.init_schema(conn, self.url, self.dialect)

    def job_version(self, job_id: str) -> tuple | None:
        """``(last_seq, updated_at)`` of the job: changes with each of its writes; None when no such job."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs.c.last_seq, jobs.c.updated_at).where(jobs.c.id == job_id)).first()
        return tuple(row) if row is not None else None

    # ---- jobs -------------------------------------------------------------------------------
    def create_job(self, spec: dict, *, name: str | None = None, priority: int = 0,
                   job_id: str | None = None, sizes: dict | None = None, owner: str = BOOTSTRAP_ADMIN) -> dict:
        """Store a new QUEUED job of ``owner`` at queue ``priority`` and its first event (seq 1, "submitted");
        returns the job."""
        name = name or spec.get("name") or "job"
        job_id = job_id or f"{name}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        try:
            with self._write() as conn:
                queued = JobState.QUEUED.value
                conn.execute(jobs.insert().values(id=job_id, name=name, spec=spec, priority=priority, state=queued,
                                                  submitted_at=now, updated_at=now, sizes=sizes, iteration=0,
                                                  last_seq=1, owner=owner))
                conn.execute(events.insert().values(job_id=job_id, seq=1, time=now, kind="state", state=queued,
                                                    message="submitted", data={"priority": priority}))
                return self._job(conn, job_id)
        except sa.exc.IntegrityError:
            if self.get_job(job_id) is None:
                raise
            raise ValueError(f"job id {job_id!r} exists already; choose another or leave it out") from None

    def get_job(self, job_id: str) -> dict | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().first()
        return dict(row) if row is not None else None

    def list_jobs(self, *, limit: int = 100, states: tuple[str, ...] | None = None, name: str | None = None,
                  before: int | None = None, owner: str | None = None) -> list[dict]:
        """Newest first, at most ``limit``, optionally only jobs in ``states``, named ``name``, of
        ``owner``, or submitted before the job whose ``number`` is ``before`` (the next page after that job)."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        query = sa.select(jobs).order_by(jobs.c.number.desc()).limit(limit)
        if states:
            query = query.where(jobs.c.state.in_(_check_states(states)))
        if name is not None:
            query = query.where(jobs.c.name == name)
        if before is not None:
            query = query.where(jobs.c.number < before)
        if owner is not None:
            query = query.where(jobs.c.owner == owner)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def jobs_in_states(self, *states: str) -> list[dict]:
        """Every job in one of ``states``, in submission order (e.g. the queue, or the jobs to resume)."""
        query = sa.select(jobs).where(jobs.c.state.in_(_check_states(states))).order_by(jobs.c.number)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    def update_job(self, job_id: str, *, state: str | None = None, message: str = "", ray_job_id: str | None = None,
                   error: dict | None = None, sizes: dict | None = None) -> dict:
        """Change a job's fields; a ``state`` change is also appended as a "state" event (so the
        history stays whole) and is refused out of a terminal state. Returns the job."""
        with self._write() as conn:
            row = self._lock(conn, job_id)
            current = row.state
            if state is not None and (state != current or current in TERMINAL_STATES):
                data = {"from": current, **({"error": error} if error is not None else {})}
                append_event_row(conn, job_id, row, {"time": time.time(), "kind": "state", "state": state,
                                                     "message": message, "data": data}, None)
            values = {k: v for k, v in (("ray_job_id", ray_job_id), ("error", error), ("sizes", sizes)) if v is not None}
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(updated_at=time.time(), **values))
            return self._job(conn, job_id)

    # ---- events -----------------------------------------------------------------------------
    def append_event(self, job_id: str, event: dict, seq: int | None = None) -> int:
        """Store ``event`` (a ``JobEvent.to_dict()``) and apply it to the job; returns its seq.

        Args:
            seq: ``None``: the next number. Given: idempotent, a replay of the event already
                stored at ``seq`` stores nothing (a writer that numbers its own events starts
                from :meth:`last_seq` + 1).

        Raises:
            UnknownJob: no such job.
            InvalidTransition: a "state" event out of a terminal state (nothing is stored).
            ValueError: another event already holds ``seq``, or the event is malformed.
        """
        with self._write() as conn:
            return append_event_row(conn, job_id, self._lock(conn, job_id), event, seq)

    def append_events(self, job_id: str, events_: list[dict]) -> int:
        """Store several events in one transaction, each as :meth:`append_event` with the next seq
        (a writer that batches, an import); all or none. Returns the last seq."""
        with self._write() as conn:
            seq = 0
            for event in events_:
                seq = append_event_row(conn, job_id, self._lock(conn, job_id), event, None)
            return seq

    def events(self, job_id: str, after_seq: int | None = None, *, kind: str | None = None,
               exclude_kind: str | None = None, limit: int | None = None) -> list[dict]:
        """The job's events in order, each with its ``seq``; only those after ``after_seq``, of
        ``kind`` and not of ``exclude_kind`` when given (``events(id, kind="placement")[-1]`` is
        where the ranks last were; ``exclude_kind="iteration"`` is a long job's history without its curve)."""
        query = sa.select(events).where(events.c.job_id == job_id).order_by(events.c.seq).limit(limit)
        if after_seq is not None:
            query = query.where(events.c.seq > after_seq)
        if kind is not None:
            query = query.where(events.c.kind == kind)
        if exclude_kind is not None:
            query = query.where(events.c.kind != exclude_kind)
        with self.engine.connect() as conn:
            rows = [_drop_job_id(r) for r in conn.execute(query).mappings()]
            if not rows:
                self._require(conn, job_id)
        return rows

    def last_seq(self, job_id: str) -> int:
        with self.engine.connect() as conn:
            self._require(conn, job_id)
            return _last_seq(conn, job_id)

    # ---- attempts and metrics (written by the events: see service.server.store_events) ----
    def attempts(self, job_id: str) -> list[dict]:
        query = sa.select(attempts).where(attempts.c.job_id == job_id).order_by(attempts.c.number)
        with self.engine.connect() as conn:
            return [_drop_job_id(r) for r in conn.execute(query).mappings()]

    def metrics(self, job_id: str, after_iteration: int | None = None) -> list[dict]:
        """One dict per iteration, in order: the metrics plus ``"iteration"``."""
        query = sa.select(metrics).where(metrics.c.job_id == job_id).order_by(metrics.c.iteration)
        if after_iteration is not None:
            query = query.where(metrics.c.iteration > after_iteration)
        with self.engine.connect() as conn:
            return [{**r.data, "iteration": r.iteration} for r in conn.execute(query)]

    def metric_rows(self, job_id: str, *, after_iteration: int = 0, limit: int | None = None) -> list[tuple]:
        """``(iteration, attempt, data)`` per iteration after ``after_iteration``, in order, at most
        ``limit`` (a page of the curve); ``attempt`` is None in rows written before schema v2."""
        query = (sa.select(metrics.c.iteration, metrics.c.attempt, metrics.c.data)
                 .where((metrics.c.job_id == job_id) & (metrics.c.iteration > after_iteration))
                 .order_by(metrics.c.iteration).limit(limit))
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(query)]

    # ---- internals --------------------------------------------------------------------------
    def _lock(self, conn: Connection, job_id: str):
        """Lock the job's row for this transaction (PostgreSQL; SQLite holds the file lock); its
        ``state``, ``metric_names``, ``last_seq`` and current ``attempt`` (one query: every
        iteration of every job passes here)."""
        attempt = (sa.select(sa.func.max(attempts.c.number)).where(attempts.c.job_id == job_id)
                   .scalar_subquery().label("attempt"))
        row = conn.execute(sa.select(jobs.c.state, jobs.c.metric_names, jobs.c.last_seq, attempt)
                           .where(jobs.c.id == job_id).with_for_update(of=jobs)).first()
        if row is None:
            raise UnknownJob(f"no job {job_id!r}")
        return row

    def _require(self, conn: Connection, job_id: str) -> None:
        if conn.execute(sa.select(jobs.c.id).where(jobs.c.id == job_id)).first() is None:
            raise UnknownJob(f"no job {job_id!r}")

    def _job(self, conn: Connection, job_id: str) -> dict:
        return dict(conn.execute(sa.select(jobs).where(jobs.c.id == job_id)).mappings().one())

def _check_states(states) -> list[str]:
    bad = [s for s in states if s not in STATES]
    if bad or not states:
        raise ValueError(f"unknown job state(s) {bad or '(none given)'}; the states are {', '.join(STATES)}")
    return list(states)


def _drop_job_id(row) -> dict:
    return {k: v for k, v in row.items() if k != "job_id"}


def _last_seq(conn: Connection, job_id: str) -> int:
    return conn.execute(sa.select(sa.func.max(events.c.seq)).where(events.c.job_id == job_id)).scalar() or 0
