"""The job store's schema: its tables, version and migrations, and SQLite's connection settings.

The version lives in the ``schema_version`` table; an older database is upgraded by
:data:`MIGRATIONS` (one step per version, inside one transaction), a newer one refused.

Version 2 keeps a job's read O(1) in its length: the ``jobs`` row carries the aggregates of
its latest iteration (``loss``, ``tokens_per_s``), the names of the metrics it reported and its
last event's seq, written with each event; each metrics row carries the attempt that wrote it
(where a restart or resize begins on the curve); events are indexed by kind, so that the few
state or placement events of a long job are found without reading its iteration events.
"""

from __future__ import annotations

from typing import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

SCHEMA_VERSION = 3
BOOTSTRAP_ADMIN = "admin"
"""The user of ``RAYTRON_API_TOKEN`` / ``DATA_DIR/api_token``; owns every job of a pre-v3 database."""
MIGRATIONS: dict[int, Callable[[Connection], None]] = {}
"""``MIGRATIONS[v](conn)`` brings a version-``v`` database to ``v + 1`` (inside one transaction)."""

_md = sa.MetaData()
_json = sa.JSON(none_as_null=True)
jobs = sa.Table(
    "jobs", _md,
    sa.Column("number", sa.Integer, primary_key=True, autoincrement=True),  # submission order
    sa.Column("id", sa.String(128), nullable=False, unique=True),
    sa.Column("name", sa.String(256), nullable=False),
    sa.Column("spec", _json, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False, index=True),
    sa.Column("submitted_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.Column("ray_job_id", sa.String(128)),
    sa.Column("error", _json),
    sa.Column("sizes", _json),
    sa.Column("iteration", sa.Integer, nullable=False),
    # v2: the latest iteration's aggregates, written with each event (never recomputed from all rows)
    sa.Column("loss", sa.Double),
    sa.Column("tokens_per_s", sa.Double),
    sa.Column("metric_names", _json),  # every metric name the job reported, sorted
    sa.Column("last_seq", sa.Integer, nullable=False, server_default="0"),
    # v3: who submitted it
    sa.Column("owner", sa.String(128), nullable=False, server_default=BOOTSTRAP_ADMIN),
    sa.Index("ix_jobs_owner_state", "owner", "state"),
)


def _job_fk() -> sa.Column:
    return sa.Column("job_id", sa.String(128), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)


events = sa.Table(
    "events", _md, _job_fk(),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("time", sa.Double, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("data", _json),
    sa.Index("ix_events_kind", "job_id", "kind", "seq"),
)
attempts = sa.Table(
    "attempts", _md, _job_fk(),
    sa.Column("number", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("started_at", sa.Double, nullable=False),
    sa.Column("ended_at", sa.Double),
    sa.Column("reason", sa.Text),
    sa.Column("from_checkpoint", sa.Text),
)
metrics = sa.Table(
    "metrics", _md, _job_fk(),
    sa.Column("iteration", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("data", _json, nullable=False),
    sa.Column("attempt", sa.Integer),  # v2: the attempt that wrote it (NULL in rows migrated from v1)
)
# v3: users, their tokens' digests and the audit trail
users = sa.Table(
    "users", _md,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("admin", sa.Boolean, nullable=False),
    sa.Column("gpu_quota", sa.Integer),  # GPU slots its running jobs may hold together; NULL: no quota
    sa.Column("max_priority", sa.Integer),  # the highest priority it may give a job; NULL: no cap
    sa.Column("created_at", sa.Double, nullable=False),
)
tokens = sa.Table(
    "tokens", _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("user", sa.String(128), sa.ForeignKey("users.name", ondelete="CASCADE"), nullable=False, index=True),
    sa.Column("digest", sa.String(64), nullable=False, unique=True),  # HMAC-SHA256(server secret, token), hex
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("revoked_at", sa.Double),
)
audit = sa.Table(
    "audit", _md,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("time", sa.Double, nullable=False),
    sa.Column("user", sa.String(128)),  # NULL: the request carried no valid token
    sa.Column("action", sa.String(64), nullable=False),
    sa.Column("target", sa.String(256)),
    sa.Column("status", sa.Integer, nullable=False),  # the HTTP status it was answered with
    sa.Column("detail", _json),
    sa.Index("ix_audit_user", "user", "id"),
)
schema_version = sa.Table("schema_version", _md, sa.Column("version", sa.Integer, nullable=False))


class SchemaError(ValueError):
    """The database's schema is not one this raytron can use; the message says what to do."""


def init_schema(conn: Connection, url: str, dialect: str) -> None:
    """Create the tables of a new database, upgrade an older one by :data:`MIGRATIONS`, refuse a newer one."""
    if dialect == "postgresql":  # two processes starting at once must not both create tables
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7242019)"))
    have = sa.inspect(conn).get_table_names()
    if "schema_version" not in have:
        if "jobs" in have:
            raise SchemaError(f"{url} has a jobs table but no schema_version: it is not a raytron "
                              "database; point --data-dir or --database-url at another one")
        _md.create_all(conn)
        conn.execute(schema_version.insert().values(version=SCHEMA_VERSION))
        return
    version = conn.execute(sa.select(schema_version.c.version)).scalar_one()
    if version > SCHEMA_VERSION:
        raise SchemaError(f"{url} has schema version {version}, newer than {SCHEMA_VERSION}, the newest "
                          f"this raytron knows: a newer raytron wrote it. Upgrade raytron (pip install -U "
                          f"raytron), or point --data-dir or --database-url at another database")
    for step in range(version, SCHEMA_VERSION):
        if step not in MIGRATIONS:
            raise SchemaError(f"{url} has schema version {version} and no migration leads from "
                              f"{step} to {step + 1}; start from a fresh data dir")
        MIGRATIONS[step](conn)
    conn.execute(schema_version.update().values(version=SCHEMA_VERSION))


def _v1_to_v2(conn: Connection) -> None:
    """Add the v2 columns and index, and fill the aggregates from the rows already there (once)."""
    for table, column in [("jobs", "loss DOUBLE PRECISION"), ("jobs", "tokens_per_s DOUBLE PRECISION"),
                          ("jobs", "metric_names JSON"), ("jobs", "last_seq INTEGER NOT NULL DEFAULT 0"),
                          ("metrics", "attempt INTEGER")]:
        conn.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN {column}"))
    next(i for i in events.indexes if i.name == "ix_events_kind").create(conn)
    for job_id, iteration in conn.execute(sa.select(jobs.c.id, jobs.c.iteration)).all():
        last = conn.execute(sa.select(sa.func.max(events.c.seq)).where(events.c.job_id == job_id)).scalar() or 0
        names: set[str] = set()
        latest: dict = {}
        for it, data in conn.execute(sa.select(metrics.c.iteration, metrics.c.data).where(metrics.c.job_id == job_id)):
            names.update(k for k in data if k != "iteration")
            if it == iteration:
                latest = data
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(
            last_seq=last, loss=number(latest.get("loss")), tokens_per_s=number(latest.get("tokens_per_s")),
            metric_names=sorted(names) or None))


def number(value) -> float | None:
    """A metric as a float column: numbers as they are, anything else (a missing value, a bool) None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


MIGRATIONS[1] = _v1_to_v2


def _v2_to_v3(conn: Connection) -> None:
    """Jobs get an owner (the bootstrap admin for those already there); the users, tokens and audit tables."""
    conn.execute(sa.text(f"ALTER TABLE jobs ADD COLUMN owner VARCHAR(128) NOT NULL DEFAULT '{BOOTSTRAP_ADMIN}'"))
    next(i for i in jobs.indexes if i.name == "ix_jobs_owner_state").create(conn)
    for table in (users, tokens, audit):
        table.create(conn)


MIGRATIONS[2] = _v2_to_v3


def sqlite_pragmas(engine: sa.Engine, busy_timeout_s: float) -> None:
    """WAL, a busy timeout, full fsync and foreign keys on every connection; writes take the lock up front."""
    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below): pysqlite's own is deferred
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = FULL")  # a commit survives a power cut, not only a kill -9
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # A deferred transaction that reads, then writes, gets SQLITE_BUSY at once (no wait) when
        # another process wrote in between; IMMEDIATE takes the write lock up front and waits.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("raytron_write") else "BEGIN")
