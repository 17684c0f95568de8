"""What the API shows of a job, built once per change of the job and served from memory.

Jobs are written by other processes (each job's runner writes its events straight into the
store), so the cache cannot be told of every write: it asks the store. A read costs one
:meth:`~service.server.store.JobStore.change_token` (SQLite's ``PRAGMA data_version``:
microseconds, no table read) when nothing was committed since the entry was built; after a
commit anywhere, one primary-key lookup of the job's version (``last_seq``, ``updated_at``)
tells whether this job changed; only then is the view built again (the job row, its attempts and
its state events: a handful of rows whatever the run's length). On a database without a change
token (PostgreSQL) every read pays the version lookup, never the rebuild.

One cache per app (``app.state.jobs``), in the server's one process: ``raytron serve`` runs a single
uvicorn worker, since the scheduler that admits and watches jobs must be one per data dir.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from service.server.store import JobStore


@dataclass
class JobView:
    """One job as the API shows it, at one version."""

    version: tuple
    """``(last_seq, updated_at)`` of the row it was built from."""
    token: Any
    """The store's change token when it was last known current."""
    summary: dict
    """:class:`api.rest.schemas.JobSummary`'s fields (a row of the job list)."""
    public: dict
    """:class:`api.rest.schemas.JobPublic`'s fields (``GET /jobs/{id}``)."""
    body: bytes
    """``public`` as JSON, encoded once."""
    memo: dict = field(default_factory=dict)
    """Answers derived from the job at this version (a downsampled curve): dropped with the view."""

    def remember(self, key, compute: Callable[[], Any], max_entries: int = 16):
        """``compute()``, once per key while the job stays at this version."""
        if key not in self.memo:
            if len(self.memo) >= max_entries:
                self.memo.clear()
            self.memo[key] = compute()
        return self.memo[key]


class JobCache:
    """Job views by id, at most ``max_entries`` (least recently used dropped).

    Args:
        store: the job store.
        build: ``build(row) -> (summary, public)``: the views of a job row (reads its attempts and
            state events; never its metrics rows).
        max_entries: how many jobs are kept.
    """

    def __init__(self, store: JobStore, build: Callable[[dict], tuple[dict, dict]], max_entries: int = 4096):
        self.store, self.build, self.max_entries = store, build, max_entries
        self._views: OrderedDict[str, JobView] = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0  # how many views were built (tests and the bench read it)

    def fresh(self, job_id: str) -> JobView | None:
        """The job's view when nothing was committed since it was known current, else None (no table read)."""
        token = self.store.change_token()
        with self._lock:
            view = self._views.get(job_id)
        return view if view is not None and token is not None and view.token == token else None

    def current(self, job_id: str) -> JobView | None:
        """The job's view, built again only when the job changed; None when there is no such job."""
        token = self.store.change_token()
        with self._lock:
            view = self._views.get(job_id)
        if view is not None and token is not None and view.token == token:
            return view
        version = self.store.job_version(job_id)
        if version is None:
            self._forget(job_id)
            return None
        if view is not None and view.version == version:
            view.token = token
            return view
        row = self.store.get_job(job_id)
        return None if row is None else self._put(row, token)

    def from_row(self, row: dict) -> JobView:
        """The view of a job row just read (the list): kept when the row's version is the cached one."""
        with self._lock:
            view = self._views.get(row["id"])
        if view is not None and view.version == _version(row):
            return view
        return self._put(row, None)  # no token: the next current() checks the version first

    def _put(self, row: dict, token) -> JobView:
        summary, public = self.build(row)
        view = JobView(_version(row), token, summary, public, json.dumps(public, separators=(",", ":")).encode())
        with self._lock:
            self.builds += 1
            self._views[row["id"]] = view
            self._views.move_to_end(row["id"])
            while len(self._views) > self.max_entries:
                self._views.popitem(last=False)
        return view

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._views.pop(job_id, None)


def _version(row: dict) -> tuple:
    return row["last_seq"], row["updated_at"]
