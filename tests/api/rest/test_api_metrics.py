"""A long job over REST: ``GET /api/v1/jobs/{id}`` stays small and fast at 20,000 iterations, and
``GET /api/v1/jobs/{id}/metrics`` pages through the curve exactly once or downsamples it.

The job is written into the server's store before the server starts (the events a job runner
records: states, 20,000 iterations, a restart from a checkpoint): running 20,000 real iterations
would take far longer than this test may. Its state events and each attempt's last iteration go
through the store's write API; the iterations between them are the same rows written in bulk
(one event through the write API costs about a millisecond: 20 s for the curve on a 2-core VM),
and test_bulk_iterations_are_the_rows_the_write_api_writes holds the two writes equal. The
server is a real ``raytron serve --launcher processes``; the job is over, so nothing runs.
"""

from __future__ import annotations

import math
import statistics
import time

import httpx
import pytest
import sqlalchemy as sa

from service.server.store import JobStore, sqlite_url
from service.server.store_schema import attempts, events, jobs, metrics
from tests.helpers.server import Server

pytestmark = pytest.mark.procs  # a real server process

ITERS = 20000
RESUMED_AT = 12001  # the second attempt resumes from the checkpoint of iteration 12000 ...
FAILED_AT = 12345  # ... after the first failed here: iterations 12001..12345 run twice
SPIKE = 7777  # one outlier a downsampled plot must still show


def loss_of(it: int, attempt: int) -> float:
    if it == SPIKE:
        return 9.0
    return 5.0 * math.exp(-it / 5000) + 0.01 * math.sin(it) + (0.001 if attempt == 2 else 0.0)


def _iterations(first: int, last: int, attempt: int, t0: float) -> list[dict]:
    return [{"time": t0 + i, "kind": "iteration", "state": "RUNNING", "message": "",
             "data": {"iteration": i, "loss": loss_of(i, attempt), "lr": 1e-3, "tokens_per_s": 1000.0 + attempt}}
            for i in range(first, last + 1)]


def _state(state: str, t: float, message: str = "", **data) -> dict:
    return {"time": t, "kind": "state", "state": state, "message": message, "data": data}


def bulk_iterations(store: JobStore, job_id: str, rows: list[dict], attempt: int) -> None:
    """Store the iteration events ``rows`` of a running attempt as :meth:`JobStore.append_events`
    would (the next seqs, each iteration's metrics row of this attempt, the job's ``last_seq``), in
    one statement per table; the job's latest figures are left to the next event through the API."""
    with store.engine.begin() as conn:
        seq = conn.execute(sa.select(jobs.c.last_seq).where(jobs.c.id == job_id)).scalar_one()
        first, last = rows[0]["data"]["iteration"], rows[-1]["data"]["iteration"]  # consecutive iterations
        conn.execute(metrics.delete().where((metrics.c.job_id == job_id) & metrics.c.iteration.between(first, last)))
        conn.execute(events.insert(), [{"job_id": job_id, "seq": seq + 1 + i, "time": e["time"], "kind": e["kind"],
                                        "state": e["state"], "message": e["message"], "data": e["data"]}
                                       for i, e in enumerate(rows)])
        conn.execute(metrics.insert(), [{"job_id": job_id, "iteration": e["data"]["iteration"], "data": e["data"],
                                         "attempt": attempt} for e in rows])
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(last_seq=seq + len(rows)))


def write_events(store: JobStore, job_id: str, plan: list[tuple[list[dict], int, int, int, float]],
                 bulk: bool = True) -> None:
    """Each attempt: its opening state events, iterations ``first..last`` at time ``t0 + i``; the
    iterations but the last in bulk (:func:`bulk_iterations`) or all through the write API."""
    for opening, first, last, attempt, t0 in plan:
        store.append_events(job_id, opening)
        rows = _iterations(first, last, attempt, t0)
        if bulk:
            bulk_iterations(store, job_id, rows[:-1], attempt)
            rows = rows[-1:]
        store.append_events(job_id, rows)


def write_long_job(data_dir, bulk: bool = True) -> str:
    """The job's record as its runner would have written it: two attempts, then SUCCEEDED."""
    store = JobStore(sqlite_url(data_dir))
    try:
        spec = {"name": "long", "training": {"train_iters": ITERS}, "resources": {"num_nodes": 1, "gpus_per_node": 1}}
        job_id = store.create_job(spec, job_id="long-1", sizes={"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1})["id"]
        write_events(store, job_id, [
            ([_state("STARTING", 1.0, from_checkpoint=None), _state("RUNNING", 2.0)], 1, FAILED_AT, 1, 10.0),
            ([_state("RESTARTING", 20000.0, "rank 0 failed"),
              _state("STARTING", 20001.0, from_checkpoint="/ckpt/iter_0012000"), _state("RUNNING", 20002.0)],
             RESUMED_AT, ITERS, 2, 20010.0)], bulk=bulk)
        store.append_events(job_id, [_state("SUCCEEDED", 50000.0)])
        for i in range(5):  # more jobs for the list, cancelled before the server starts (nothing runs them)
            store.create_job({"name": "page" if i % 2 else "other"}, job_id=f"page-{i}")
            store.update_job(f"page-{i}", state="CANCELLED", message="test")
        return job_id
    finally:
        store.close()


def test_bulk_iterations_are_the_rows_the_write_api_writes(tmp_path):
    """The shortcut of write_long_job, on a short job with a restart that runs iterations again:
    every table's rows as when each event goes through the write API (times of writing aside)."""
    written = {}
    for bulk in (False, True):
        store = JobStore(sqlite_url(tmp_path / str(bulk)))
        try:
            job_id = store.create_job({"name": "short"}, job_id="short-1")["id"]
            write_events(store, job_id, [([_state("STARTING", 1.0), _state("RUNNING", 2.0)], 1, 30, 1, 10.0),
                                         ([_state("RESTARTING", 100.0, "rank 0 failed"), _state("STARTING", 101.0),
                                           _state("RUNNING", 102.0)], 21, 40, 2, 110.0)], bulk=bulk)
            store.append_events(job_id, [_state("SUCCEEDED", 500.0)])
            with store.engine.connect() as conn:
                written[bulk] = {table.name: [dict(r) for r in conn.execute(sa.select(table).order_by(
                    *table.primary_key)).mappings()] for table in (jobs, events, metrics, attempts)}
            for row in written[bulk]["jobs"] + written[bulk]["events"][:1]:  # the clock's: the job's creation
                for key in ("submitted_at", "updated_at", "time"):
                    row.pop(key, None)
        finally:
            store.close()
    assert written[True] == written[False]  # mutation: attempt=1 for the rows of the second attempt -> differ
    assert len(written[True]["metrics"]) == 40 and written[True]["jobs"][0]["iteration"] == 40


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("long")
    job_id = write_long_job(data_dir)
    srv = Server(data_dir).start()
    yield srv, job_id
    srv.stop()
    srv.kill_runners()
    assert "Traceback" not in srv.log.read_text()


@pytest.fixture
def api(long_server):
    with long_server[0].client() as c:
        yield c


def expected_curve() -> tuple[list[int], list[float]]:
    iterations = list(range(1, ITERS + 1))
    return iterations, [loss_of(i, 2 if i >= RESUMED_AT else 1) for i in iterations]


def test_a_long_job_reads_small_and_fast(long_server, api):
    """50 reads of a 20,000-iteration job: p50 under 20 ms, each body under 16 KB, its latest figures right."""
    _, job_id = long_server
    api.get(f"/jobs/{job_id}")  # the first read builds the view
    times, sizes = [], []
    for _ in range(50):
        t0 = time.perf_counter()
        r = api.get(f"/jobs/{job_id}")
        times.append(time.perf_counter() - t0)
        sizes.append(len(r.content))
        assert r.status_code == 200
    job = r.json()
    print(f"GET /jobs/{{id}} at {ITERS} iterations: p50 {1000 * statistics.median(times):.1f} ms, "
          f"max {1000 * max(times):.1f} ms, {max(sizes)} bytes")
    assert max(sizes) < 16 * 1024  # mutation: the whole curve back in the job -> ~600 KB
    assert statistics.median(times) < 0.020
    assert (job["state"], job["iteration"], job["restarts"], len(job["attempts"])) == ("SUCCEEDED", ITERS, 1, 2)
    assert job["loss"] == pytest.approx(loss_of(ITERS, 2)) and job["tokens_per_s"] == 1002.0
    assert job["metric_names"] == ["loss", "lr", "tokens_per_s"] and "losses" not in job


def test_paging_with_after_walks_the_curve_exactly_once(api, long_server):
    _, job_id = long_server
    for limit in (1000, 777):  # pages that divide the curve evenly, and ones that do not
        iterations, losses, attempts, after, pages = [], [], [], 0, 0
        while after is not None:
            body = api.get(f"/jobs/{job_id}/metrics", params={"names": "loss", "after": after, "limit": limit}).json()
            assert set(body) == {"job_id", "iterations", "attempt", "loss", "next_after"}
            assert len(body["iterations"]) <= limit
            iterations += body["iterations"]
            losses += body["loss"]
            attempts += body["attempt"]
            after, pages = body["next_after"], pages + 1
        want_its, want_losses = expected_curve()
        assert iterations == want_its  # each once, in order (mutation: next_after = last + 1 -> skips one)
        assert losses == pytest.approx(want_losses)  # the latest attempt's values where it ran again
        assert pages == math.ceil(ITERS / limit)
        assert attempts == [1] * (RESUMED_AT - 1) + [2] * (ITERS - RESUMED_AT + 1)


def test_points_downsample_keeps_ends_restarts_and_spikes(api, long_server):
    _, job_id = long_server
    t0 = time.perf_counter()
    body = api.get(f"/jobs/{job_id}/metrics", params={"points": 500, "names": "loss,lr"}).json()
    t1 = time.perf_counter()
    again = api.get(f"/jobs/{job_id}/metrics", params={"points": 500, "names": "loss,lr"}).json()
    print(f"?points=500 of {ITERS}: {1000 * (t1 - t0):.0f} ms, again (remembered) "
          f"{1000 * (time.perf_counter() - t1):.0f} ms")
    assert again == body
    its = body["iterations"]
    assert len(its) <= 500 and len(body["loss"]) == len(body["lr"]) == len(its)
    assert its[0] == 1 and its[-1] == ITERS and its == sorted(set(its))  # both ends, ascending, once each
    assert RESUMED_AT in its  # the restart's first point (mutation: attempt starts not kept -> missing)
    assert SPIKE in its and max(body["loss"]) == 9.0  # min/max buckets keep the outlier
    assert body["next_after"] is None
    _, want = expected_curve()
    assert all(body["loss"][k] == pytest.approx(want[i - 1]) for k, i in enumerate(its))
    small = api.get(f"/jobs/{job_id}/metrics", params={"points": 2}).json()["iterations"]
    assert small == [1, ITERS]


def test_metrics_requests_that_are_wrong_are_4xx(api, long_server):
    _, job_id = long_server
    assert api.get("/jobs/nope/metrics").status_code == 404
    for params in ({"names": "iterations"}, {"names": "loss;drop"}, {"after": -1}, {"points": 1},
                   {"limit": 0}, {"after": 2**40}):
        r = api.get(f"/jobs/{job_id}/metrics", params=params)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", (params, r.text)
    r = api.get(f"/jobs/{job_id}/metrics", params={"names": "no_such_metric", "limit": 3}).json()
    assert r["no_such_metric"] == [None, None, None]


def test_a_write_from_another_process_is_seen_at_once(long_server, api):
    """The cache never serves a stale job: a write by another connection (a job runner's) is in the next read."""
    srv, job_id = long_server
    before = api.get(f"/jobs/{job_id}").json()
    other = JobStore(sqlite_url(srv.data_dir))
    try:
        other.update_job(job_id, ray_job_id="raysubmit_cache_check")  # changes the row, not its last_seq
    finally:
        other.close()
    after = api.get(f"/jobs/{job_id}").json()
    assert before["ray_job_id"] is None and after["ray_job_id"] == "raysubmit_cache_check"  # mutation: no check


def test_the_job_list_pages_and_filters(long_server, api):
    srv, job_id = long_server
    ids = [f"page-{i}" for i in range(5)]
    seen, cursor = [], None
    while True:
        body = api.get("/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [j["id"] for j in body["jobs"]]
        assert body["count"] == len(body["jobs"]) <= 2
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1] + [job_id]  # newest first, each once
    assert [j["id"] for j in api.get("/jobs", params={"name": "page"}).json()["jobs"]] == ["page-3", "page-1"]
    assert [j["id"] for j in api.get("/jobs", params={"state": "SUCCEEDED"}).json()["jobs"]] == [job_id]
    for params in ({"state": ""}, {"state": "DONE"}, {"cursor": "x"}, {"limit": 0}):
        r = api.get("/jobs", params=params)
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", params
    assert httpx.get(f"{srv.url}/api/v1/jobs").status_code == 401
