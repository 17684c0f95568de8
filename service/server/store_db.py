"""The job store's database: one engine over SQLite or any SQLAlchemy URL, its write transactions, and the change token readers' caches compare.

SQLAlchemy Core over SQLite by default (one file in the data dir, WAL journal, a busy timeout)
or any database a ``database_url`` names (PostgreSQL is tested). Several threads and several
processes (the server and each job's controller) write at once: every write is one
transaction that first locks the job's row on PostgreSQL (``SELECT ... FOR UPDATE``) and, on
SQLite, starts with ``BEGIN IMMEDIATE`` so that writers queue on the file lock for up to
``busy_timeout_s`` instead of failing when a read lock cannot be upgraded. Readers in WAL
mode never wait for a writer. WAL needs the processes on one machine with the file on a local
disk (not NFS): writers on other machines need PostgreSQL.

:class:`~service.server.store.JobStore` is a :class:`Database` with the job tables; the
accounts (:mod:`service.server.accounts`) write through the same transactions.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlalchemy as sa
from sqlalchemy.engine import Connection, make_url

from service.server.store_schema import sqlite_pragmas


class Database:
    """One database, shared by threads and processes (see the module docstring).

    Args:
        database_url: a SQLAlchemy URL.
        busy_timeout_s: SQLite only: how long a writer waits for another's lock before failing.

    Raises:
        ValueError: an in-memory SQLite URL (each connection would see its own database).
    """

    def __init__(self, database_url: str, *, busy_timeout_s: float = 30.0):
        url = make_url(database_url)
        self.url = url.render_as_string(hide_password=True)
        self.dialect = url.get_backend_name()
        if self.dialect == "sqlite":
            if url.database in (None, "", ":memory:"):
                raise ValueError(f"database_url {self.url!r} is an in-memory SQLite database, which every "
                                 "connection sees empty; use a file, e.g. sqlite:////tmp/raytron/raytron.db")
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
            self.engine = sa.create_engine(url, connect_args={"timeout": busy_timeout_s, "check_same_thread": False})
            sqlite_pragmas(self.engine, busy_timeout_s)
        else:
            self.engine = sa.create_engine(url, pool_pre_ping=True)
        self._writer = self.engine.execution_options(raytron_write=True)
        self._watch = None  # SQLite: a connection kept only to ask PRAGMA data_version
        self._watch_lock = threading.Lock()

    def close(self) -> None:
        with self._watch_lock:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
        self.engine.dispose()

    # ---- change detection (for readers' caches) ---------------------------------------------
    def change_token(self) -> int | None:
        """A value that changes whenever anyone (this store, another thread or another process)
        commits a write; ``None`` where the database cannot tell cheaply (not SQLite), and then a
        cache compares the job store's ``job_version`` on every read.

        On SQLite this is ``PRAGMA data_version`` of a connection that never writes: it changes
        when any other connection, in this process or another, commits (microseconds: SQLite
        looks at the WAL index in shared memory, no table is read).
        """
        if self.dialect != "sqlite":
            return None
        with self._watch_lock:
            if self._watch is None:
                self._watch = self.engine.raw_connection()
            cur = self._watch.cursor()
            try:
                version = cur.execute("PRAGMA data_version").fetchone()[0]
            finally:
                cur.close()
        return version

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._writer.begin() as conn:
            yield conn
