"""api/rest/job_cache.py over a real SQLite store: a job's view is built once per change of that job,
whoever wrote the change (this store, or another connection as a job runner is)."""

from __future__ import annotations

import pytest

from api.rest.job_cache import JobCache
from api.rest.routes.jobs import job_views
from service.server.store import JobStore, sqlite_url


@pytest.fixture
def store(tmp_path):
    s = JobStore(sqlite_url(tmp_path))
    yield s
    s.close()


def it(i: int, loss: float) -> dict:
    return {"time": float(i), "kind": "iteration", "state": "RUNNING", "message": "", "data": {"iteration": i, "loss": loss}}


def test_reads_of_an_unchanged_job_build_nothing(store, tmp_path):
    cache = JobCache(store, lambda row: job_views(store, row))
    job = store.create_job({"name": "c"})["id"]
    other_job = store.create_job({"name": "d"})["id"]
    assert cache.current(job).public["iteration"] == 0 and cache.builds == 1
    for _ in range(100):
        assert cache.fresh(job) is not None and cache.current(job) is not None
    assert cache.builds == 1  # mutation: no token check -> 101 builds

    writer = JobStore(sqlite_url(tmp_path))  # another connection: as a job runner writes
    try:
        writer.append_event(other_job, it(1, 3.0))
        assert cache.fresh(job) is None  # something was committed: the view is not known current ...
        assert cache.current(job).public["iteration"] == 0 and cache.builds == 1  # ... but this job did not change
        writer.append_event(job, it(1, 2.5))
    finally:
        writer.close()
    view = cache.current(job)
    assert (view.public["iteration"], view.public["loss"], cache.builds) == (1, 2.5, 2)  # mutation: version ignored
    assert cache.current("nope") is None


def test_the_list_reuses_views_of_unchanged_rows(store):
    cache = JobCache(store, lambda row: job_views(store, row))
    ids = [store.create_job({"name": f"j{i}"})["id"] for i in range(3)]
    for _ in range(5):
        assert [cache.from_row(r).summary["id"] for r in store.list_jobs()] == ids[::-1]
    assert cache.builds == 3
    store.append_event(ids[0], it(1, 1.0))
    assert [cache.from_row(r).summary["loss"] for r in store.list_jobs()] == [None, None, 1.0]
    assert cache.builds == 4


def test_the_oldest_views_are_dropped_beyond_max_entries(store):
    cache = JobCache(store, lambda row: job_views(store, row), max_entries=2)
    ids = [store.create_job({"name": f"j{i}"})["id"] for i in range(3)]
    for job in ids:
        cache.current(job)
    cache.current(ids[0])
    assert cache.builds == 4  # ids[0] was dropped for ids[2], and built again
