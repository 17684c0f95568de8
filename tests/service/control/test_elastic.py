"""Elastic data parallelism: the scaling policy as a pure function, and the controller's resize
and grow-back steps against a fake rank group (milliseconds; the Ray drills are in
test_elastic_ray.py, shrink and grow back, and test_serve_faults.py, shrink through the server)."""

from __future__ import annotations

import pytest

from service.control.controller import JobController
from service.control.errors import RankDied
from service.control.events import JobState
from service.control.policy import ElasticDataParallel, resized
from service.spec.spec import batch_problem
from service.spec.spec import parse_spec, to_job_config
from workers.grid import ParallelGrid
from tests.helpers.elastic import MODEL, ResumingGroup  # noqa: F401


def make_job(num_nodes=4, gpus=1, min_nodes=1, gbs=8, tp=1, pp=1, vpp=None, iters=8, grace=0.1, layers=2):
    return to_job_config(parse_spec({
        "name": "el", "model": {**MODEL, "num_layers": layers},
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "virtual_pipeline_model_parallel_size": vpp},
        "training": {"train_iters": iters, "global_batch_size": gbs, "micro_batch_size": 1},
        "checkpoint": {"save_interval": 2, "dir": "/nonexistent-raytron-test"},
        "resources": {"num_nodes": num_nodes, "gpus_per_node": gpus, "min_nodes": min_nodes},
        "fault_tolerance": {"max_restarts": 3, "node_grace_s": grace}}))


@pytest.mark.parametrize("kw, available, expected", [
    (dict(), 4, 4),
    (dict(), 3, 2),            # dp 3 does not divide the global batch 8: dp 2
    (dict(), 1, 1),
    (dict(min_nodes=3), 2, None),  # never below min_nodes
    (dict(gbs=12), 3, 3),
    (dict(num_nodes=4, gpus=2, tp=2, gbs=8), 3, 2),   # tp stays 2: dp 4 -> 2
    (dict(num_nodes=4, gpus=1, pp=2, gbs=8, layers=4), 3, 2),  # pp 2 needs an even world: 2 nodes
    (dict(num_nodes=12, pp=2, vpp=2, gbs=12, layers=4), 8, 6),  # interleaved: 3 microbatches are not a multiple of pp
    (dict(), 9, 4),            # never above num_nodes
])
def test_scaling_policy_picks_the_largest_valid_size(kw, available, expected):
    job = make_job(**kw)
    decision = ElasticDataParallel().decide(job, available)
    assert decision.num_nodes == expected, decision.reason
    if expected is None:
        assert "min_nodes" in decision.reason
    else:
        grid = ParallelGrid.from_config(job.parallel, expected * job.gpus_per_node)
        assert decision.sizes == grid.sizes() and not batch_problem(job.training.global_batch_size, job.training.micro_batch_size, grid)
        small = resized(job, expected)
        assert (small.world_size, small.training.global_batch_size) == (grid.world_size, job.training.global_batch_size)
        assert (grid.tp, grid.pp, grid.cp, grid.ep) == (job.parallel.tensor_model_parallel_size,
                                                        job.parallel.pipeline_model_parallel_size, 1, 1)


def test_lost_node_shrinks_dp_then_grows_back_at_a_checkpoint():
    job = make_job()
    nodes, reached, sizes, events = [4], [0], [], []

    def make(attempt, attempt_job, grid):
        sizes.append((attempt_job.num_nodes, grid.dp))
        if attempt == 0:
            return ResumingGroup(grid.world_size, reached, fail_at=4, on_fail=lambda: nodes.__setitem__(0, 3))
        group = ResumingGroup(grid.world_size, reached)
        if attempt_job.num_nodes == 2:  # the node comes back while the job runs small
            run = group.run
            group.run = lambda n: (nodes.__setitem__(0, 4) if group.it >= 5 else None) or run(n)
        return group

    ctrl = JobController(job, ParallelGrid.from_config(job.parallel, job.world_size), job_id="el",
                         make_group=make, on_event=events.append, nodes_available=lambda: nodes[0])
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED", result
    assert result["losses"] == [1.0 / i for i in range(1, 9)]  # the whole curve, each iteration once
    assert sizes == [(4, 4), (2, 2), (4, 4)]
    resizes = [e.data for e in events if e.kind == "resize"]
    assert [(r["old"]["sizes"]["dp"], r["new"]["sizes"]["dp"]) for r in resizes] == [(4, 2), (2, 4)]
    starts = [e.data for e in events if e.kind == "state" and e.state is JobState.STARTING]
    assert [s["num_nodes"] for s in starts] == [4, 2, 4]
    assert result["restarts"] == 1 and result["sizes"]["dp"] == 4


def test_no_valid_size_fails_with_the_reason():
    job = make_job(min_nodes=4, num_nodes=4)
    job = resized(job, 4)
    nodes, reached = [4], [0]
    make = lambda attempt, j, g: ResumingGroup(g.world_size, reached, fail_at=3 if attempt == 0 else None,  # noqa: E731
                                               on_fail=lambda: nodes.__setitem__(0, 2))
    result = JobController(job, ParallelGrid.from_config(job.parallel, 4), job_id="nf", make_group=make,
                           nodes_available=lambda: nodes[0]).run()
    # min_nodes == num_nodes: not elastic; the launcher's placement decides (the fake fits)
    assert result["state"] == "SUCCEEDED"
    job = make_job(min_nodes=3)
    nodes, reached = [4], [0]
    result = JobController(job, ParallelGrid.from_config(job.parallel, 4), job_id="nf2", make_group=make,
                           nodes_available=lambda: nodes[0]).run()
    assert result["state"] == "FAILED" and "resources.min_nodes 3" in result["error"], result


def test_the_store_records_resizes_and_attempts_from_the_controller_events(tmp_path):
    """The runner's recorder turns a resize into the job's sizes column and STARTING's
    from_checkpoint into the attempt row (what GET /api/v1/jobs/{id} shows)."""
    from service.server.job_main import StoreRecorder
    from service.server.store import JobStore, sqlite_url

    store = JobStore(sqlite_url(tmp_path))
    job = make_job()
    store.create_job({"name": "el"}, job_id="el-1", sizes={"dp": 4})
    nodes, reached = [4], [0]

    def make(attempt, attempt_job, grid):
        return ResumingGroup(grid.world_size, reached, fail_at=4 if attempt == 0 else None,
                             on_fail=lambda: nodes.__setitem__(0, 3))

    result = JobController(job, ParallelGrid.from_config(job.parallel, 4), job_id="el-1", make_group=make,
                           on_event=StoreRecorder(store, "el-1"), nodes_available=lambda: nodes[0]).run()
    assert result["state"] == "SUCCEEDED"
    row = store.get_job("el-1")
    assert row["sizes"]["dp"] == 2 and row["sizes"] == result["sizes"]
    attempts = store.attempts("el-1")
    assert [a["from_checkpoint"] for a in attempts] == [None, None] and len(attempts) == 2
    store.close()


def test_a_job_that_may_not_shrink_says_it_waits_for_a_replacement():
    """Without min_nodes below num_nodes a lost node means waiting for a replacement: the attempt
    after the loss says so in a ``waiting`` event (with the numbers) and runs when the node is back.
    Fails if the wait is silent."""
    job = make_job(min_nodes=4)
    nodes, reached, events = [4], [0], []

    def make(attempt, attempt_job, grid):
        if attempt == 0:
            return ResumingGroup(grid.world_size, reached, fail_at=3, on_fail=lambda: nodes.__setitem__(0, 3))
        nodes[0] = 4  # the replacement arrives while the launcher waits for its placement
        return ResumingGroup(grid.world_size, reached)

    result = JobController(job, ParallelGrid.from_config(job.parallel, 4), job_id="w", make_group=make,
                           on_event=events.append, nodes_available=lambda: nodes[0]).run()
    assert result["state"] == "SUCCEEDED" and result["sizes"]["dp"] == 4
    waiting = [e for e in events if e.kind == "waiting"]
    assert len(waiting) == 1 and waiting[0].data == {"available": 3, "needed": 4}, waiting
    assert "waiting for a replacement" in waiting[0].message and "min_nodes" in waiting[0].message
