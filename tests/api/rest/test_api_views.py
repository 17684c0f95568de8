"""What the REST API shows of a job, read straight from a job store that a controller wrote
through the job runner's recorder: the list's summary, restarts after a resize, the placement
view, the state vocabulary. No server and no rank processes (the route functions are called
as functions; test_api.py runs them behind a real server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.control.controller import JobController
from service.control.errors import InsufficientResources
from service.control.events import JobState
from service.server.job_main import StoreRecorder
from service.server.store import JobStore, sqlite_url
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.elastic import MODEL, ResumingGroup
from workers.grid import ParallelGrid


@pytest.fixture
def store(tmp_path):
    s = JobStore(sqlite_url(tmp_path))
    yield s
    s.close()


def get_job(job_id: str, store: JobStore) -> dict:
    """What GET /api/v1/jobs/{id} answers (its view, built as the route's cache builds it)."""
    from api.rest.routes.jobs import job_public

    return job_public(store, store.get_job(job_id))


def list_jobs(store: JobStore) -> list:
    """What GET /api/v1/jobs lists (the summaries, newest first)."""
    from api.rest.routes.jobs import job_summary
    from api.rest.schemas import JobSummary

    return [JobSummary(**job_summary(store, r)) for r in store.list_jobs()]


def elastic_spec(num_nodes=4, gpus_per_node=1, pp=1) -> dict:
    """The spec of test_elastic's job (make_job()): elastic down to 1 node, a checkpoint every 2 iterations."""
    return {"name": "el", "model": dict(MODEL), "parallel": {"pipeline_model_parallel_size": pp},
            "training": {"train_iters": 8, "global_batch_size": 8, "micro_batch_size": 1},
            "checkpoint": {"save_interval": 2, "dir": "/nonexistent-raytron-test"},
            "resources": {"num_nodes": num_nodes, "gpus_per_node": gpus_per_node, "min_nodes": 1},
            "fault_tolerance": {"max_restarts": 3, "node_grace_s": 0.1}}


def run_recorded(store: JobStore, job_id: str, make_group, nodes: list[int], spec: dict | None = None) -> dict:
    """Run ``spec`` (default :func:`elastic_spec`) to its end as the server would: stored first, its
    events recorded into ``store`` by the runner's StoreRecorder. Returns the controller's result."""
    spec = spec or elastic_spec()
    job = to_job_config(parse_spec(spec))
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    store.create_job(spec, job_id=job_id, sizes=grid.sizes())
    return JobController(job, grid, job_id=job_id, make_group=make_group, on_event=StoreRecorder(store, job_id),
                         nodes_available=lambda: nodes[0]).run()


def shrink_then_grow(nodes: list[int], reached: list[int]):
    """A node is lost at iteration 4 (a rank failure: a restart, at dp 2), and comes back while
    the job runs small: it grows back to dp 4 at its next checkpoint (a resize, not a restart)."""
    def make(attempt, attempt_job, grid):
        if attempt == 0:
            return ResumingGroup(grid.world_size, reached, fail_at=4, on_fail=lambda: nodes.__setitem__(0, 3))
        group = ResumingGroup(grid.world_size, reached)
        if attempt_job.num_nodes == 2:
            run = group.run
            group.run = lambda n: (nodes.__setitem__(0, 4) if group.it >= 5 else None) or run(n)
        return group
    return make


def test_a_resized_job_counts_its_restarts_as_the_controller_does(store):
    """One restart (the lost node) and two resizes (the shrink, the grow): three attempts, one
    restart, in ``raytron run --json`` (the controller's result), GET /jobs/{id}, the list and /metrics."""
    from api.rest.routes.health import metrics

    nodes, reached = [4], [0]
    result = run_recorded(store, "el-1", shrink_then_grow(nodes, reached), nodes)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1, result
    job = get_job("el-1", store)
    assert [a["number"] for a in job["attempts"]] == [1, 2, 3]  # an attempt per size: 4, 2, 4 nodes
    starts = [e["message"] for e in store.events("el-1", kind="state") if e["state"] == "STARTING"]
    assert "(attempt 2)" in starts[1] and "(attempt 3)" in starts[2], starts  # the controller numbers them alike
    assert job["restarts"] == result["restarts"]  # mutation: restarts = attempts - 1 -> 2
    assert list_jobs(store)[0].restarts == result["restarts"]
    text = metrics(store, SimpleNamespace(queue_length=lambda: 0)).body.decode()
    assert 'raytron_job_restarts{job_id="el-1",name="el"} 1.0' in text


def test_a_shrink_while_waiting_for_nodes_is_not_a_restart(store):
    """A node lost while an attempt waits for its placement: the launcher's InsufficientResources
    makes the controller size the job again (a new attempt, no restart)."""
    nodes, reached = [4], [0]

    def make(attempt, attempt_job, grid):
        group = ResumingGroup(grid.world_size, reached, fail_at=4 if attempt == 0 else None,
                              on_fail=lambda: nodes.__setitem__(0, 3))
        if attempt == 1 and attempt_job.num_nodes == 2 and not getattr(make, "waited", False):
            make.waited = True  # the restart's placement finds a second node gone
            nodes[0] = 1

            def start(faults):
                raise InsufficientResources("2 nodes wanted, 1 left")
            group.start = start
        return group

    result = run_recorded(store, "el-2", make, nodes)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1, result
    job = get_job("el-2", store)
    assert len(job["attempts"]) == 3 and job["restarts"] == result["restarts"]
    assert [e["state"] for e in store.events("el-2", kind="state")].count(JobState.RESTARTING.value) == 2


def test_the_list_carries_what_the_jobs_page_shows(store):
    """Each summary of GET /jobs has the row's state, sizes (as resized), iteration, latest loss and
    restarts, so that the console's jobs page needs no request per job; the curve stays out."""
    from api.rest.schemas import JobSummary

    nodes, reached = [4], [0]
    result = run_recorded(store, "el-3", shrink_then_grow(nodes, reached), nodes)
    store.create_job(elastic_spec(), job_id="queued-1")
    queued, listed = list_jobs(store)
    job = get_job("el-3", store)
    assert (listed.id, listed.state, listed.iteration, listed.train_iters) == ("el-3", "SUCCEEDED", 8, 8)
    assert listed.sizes == result["sizes"] == job["sizes"] and listed.sizes["dp"] == 4  # grown back
    assert listed.loss == result["losses"][-1] == job["loss"] == 1 / 8
    assert listed.restarts == job["restarts"] == 1
    assert (queued.iteration, queued.loss, queued.restarts) == (0, None, 0)
    assert "losses" not in JobSummary.model_fields and "loss" in job


def test_the_placement_view_is_the_reported_ranks_completed_from_the_attempts_plan(store):
    """GET /jobs/{id}/placement: the latest attempt's ranks, by rank, each with the node it is drawn
    in and what its record lacks from that attempt's plan (at the size it ran: here shrunk to one
    node, where rank 1 is pp 1, not dp 1 as in the spec's two-node plan)."""
    from api.rest.routes.jobs import get_placement

    nodes, reached = [2], [0]

    def make(attempt, attempt_job, grid):  # the fake ranks report rank, node_id and pid only
        return ResumingGroup(grid.world_size, reached, fail_at=4 if attempt == 0 else None,
                             on_fail=lambda: nodes.__setitem__(0, 1))

    result = run_recorded(store, "pp-1", make, nodes, elastic_spec(num_nodes=2, gpus_per_node=2, pp=2))
    assert result["state"] == "SUCCEEDED" and result["world_size"] == 2, result
    view = get_placement("pp-1", store)
    assert (view["attempt"], view["gpus_per_node"]) == (2, 2)
    assert [(r["rank"], r["node"], r["local"], r["pp"], r["dp"]) for r in view["ranks"]] == [
        (0, "n0", 0, 0, 0), (1, "n1", 1, 1, 0)]  # mutation: planned at the spec's size -> rank 1 dp 1, pp 0
    assert all(r["pid"] == r["rank"] and r["etp"] == 0 and r["expert_dp"] == 0 for r in view["ranks"])


def test_a_rank_is_drawn_in_its_launchers_node_else_its_ray_node_else_its_host():
    from api.rest.placement_view import placement_view

    reported = [
        {"rank": 2, "node_id": None, "hostname": "box", "local": 0, "tp": 0},      # a local process
        {"rank": 0, "node": 1, "node_id": None, "hostname": "box", "local": 0, "tp": 0},  # the process launcher's
        {"rank": 1, "node_id": "ray-abc", "hostname": "box", "local": 1, "tp": 1},  # a Ray actor
    ]
    view = placement_view(reported)
    assert [(r["rank"], r["node"]) for r in view] == [(0, 1), (1, "ray-abc"), (2, "box")]
    planned = [{"rank": r, "node": r // 2, "local": r % 2, "tp": r % 2, "pp": 0} for r in range(4)]
    view = placement_view([{"rank": 3, "pid": 9}], lambda: planned, nodes=["node-0", "node-1"])
    assert view == [{"rank": 3, "pid": 9, "local": 1, "tp": 1, "pp": 0, "node": "node-1"}]  # nothing reported: admitted
    calls = []
    placement_view([{"rank": 0, **dict.fromkeys(("local", "tp", "cp", "dp", "pp", "ep", "etp", "expert_dp"), 0)}],
                   lambda: calls.append(1) or planned)
    assert calls == []  # a whole record: no plan made


def test_the_job_states_come_from_job_state():
    from api.rest.routes.jobs import job_states

    body = job_states()
    assert body["states"] == [s.value for s in JobState]
    assert body["terminal"] == [s.value for s in JobState if s.is_terminal] == ["SUCCEEDED", "FAILED", "CANCELLED"]
