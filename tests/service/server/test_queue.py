"""Gang admission, pure: no Ray, no processes. Free slots are plain per-node counts."""

from __future__ import annotations

import random

import pytest

from service.server.queue import QueuedJob, admit, can_ever_fit, place_gang, queue_order


def job(id: str, t: float, nodes: int = 1, gpus: int = 4, priority: int = 0) -> QueuedJob:
    return QueuedJob(id=id, submitted_at=t, num_nodes=nodes, gpus_per_node=gpus, priority=priority)


def started(plan) -> list[str]:
    return [a.job.id for a in plan.start]


def test_higher_priority_first():
    low, high = job("low", 1.0), job("high", 2.0, priority=5)
    assert [j.id for j in queue_order([low, high, job("neg", 0.0, priority=-1)])] == ["high", "low", "neg"]
    plan = admit([4], [low, high])
    assert started(plan) == ["high"]
    assert plan.waiting[0][0].id == "low" and "waits behind job high" not in plan.waiting[0][1]
    assert started(admit([4, 4], [low, high])) == ["high", "low"]


def test_fifo_among_equal_priorities():
    jobs = [job("b", 2.0), job("a", 1.0), job("c", 3.0), job("a2", 1.0)]
    assert [j.id for j in queue_order(jobs)] == ["a", "a2", "b", "c"]  # same time: by id, the same every call
    assert started(admit([4, 4], jobs)) == ["a", "a2"]
    assert started(admit([4, 4, 4], jobs)) == ["a", "a2", "b"]


def test_a_gang_never_starts_in_part():
    # 12 free slots >= the 8 it needs, but only one node has 4 free: no partial start.
    plan = admit([8, 2, 2], [job("wide", 1.0, nodes=2, gpus=4)])
    assert plan.start == [] and plan.free == {0: 8, 1: 2, 2: 2}
    assert "needs 2 node(s) with 4 free GPU slots each; 1 node(s) have that many free now (12" in plan.waiting[0][1]
    # its bundles need distinct nodes: 8 free on one node is not 2 nodes x 2
    assert admit([8, 1], [job("two", 1.0, nodes=2, gpus=2)]).start == []
    plan = admit([8, 1, 2], [job("two", 1.0, nodes=2, gpus=2)])
    assert plan.start[0].nodes == (2, 0) and plan.free == {0: 6, 1: 1, 2: 0}


def test_two_whole_cluster_jobs_run_one_after_the_other():
    total = [4, 4]
    first, second = job("first", 1.0, nodes=2), job("second", 2.0, nodes=2)
    plan = admit(total, [first, second], cluster_total=total)
    assert started(plan) == ["first"] and [j.id for j, _ in plan.waiting] == ["second"]
    assert plan.free == {0: 0, 1: 0}
    assert admit(plan.free, [second], cluster_total=total).start == []  # while the first runs
    plan = admit(total, [second], cluster_total=total)  # the first finished: its slots are free again
    assert started(plan) == ["second"] and plan.start[0].nodes == (0, 1)


def test_strict_order_a_small_job_does_not_jump_a_blocked_head():
    running_frees = [4, 2]  # a job holds 2 slots of node 1
    head, small = job("head", 1.0, nodes=2, gpus=4, priority=1), job("small", 2.0, nodes=1, gpus=2)
    plan = admit(running_frees, [small, head])
    assert plan.start == []
    assert plan.waiting[1] == (small, "waits behind job head (priority 1), which is first in the queue and waits "
                                      "for GPU slots")
    assert started(admit([4, 4], [small, head])) == ["head"]  # then the head starts first


def test_best_fit_keeps_big_nodes_whole():
    assert place_gang(job("x", 0, nodes=1, gpus=4), [8, 4, 6]) == (1,)
    plan = admit([8, 4], [job("narrow", 1.0, gpus=4), job("big", 2.0, gpus=8)])
    assert started(plan) == ["narrow", "big"] and plan.start[0].nodes == (1,)


def test_node_ids_and_validation():
    plan = admit({"node-a": 4, "node-b": 2}, [job("j", 1.0, nodes=1, gpus=2)])
    assert plan.start[0].nodes == ("node-b",) and plan.free == {"node-a": 4, "node-b": 0}
    with pytest.raises(ValueError, match="resources.num_nodes must be a positive integer, got 0"):
        job("z", 1.0, nodes=0)
    with pytest.raises(ValueError, match="GPU slot counts must be integers >= 0"):
        admit([4, -1], [])
    with pytest.raises(ValueError, match=r"job ids \['a'\] are queued more than once"):
        admit([4], [job("a", 1.0), job("a", 2.0)])


def test_never_fits_message_and_it_does_not_block_the_queue():
    total = [4, 4]
    assert can_ever_fit(job("ok", 0, nodes=2, gpus=4), total) is None
    msg = can_ever_fit(job("big", 0, nodes=3, gpus=4), total)
    assert msg == ("job big needs 3 node(s) x 4 GPU slots = 12 GPU slots at once, but the cluster has 2 node(s) x 4 "
                   "GPU slots = 8 GPU slots, of which 2 node(s) hold 4 or more: it can never start; lower "
                   "resources.num_nodes to at most 2 (and the world size with it) or add nodes with 4 or more GPU "
                   "slots")
    msg = can_ever_fit(job("fat", 0, nodes=1, gpus=8), {"a": 4, "b": 4, "c": 2})
    assert "needs 1 node(s) x 8 GPU slots = 8" in msg and "2 node(s) x 4 GPU slots + 1 node(s) x 2 GPU slots = 10" \
        in msg and "lower resources.gpus_per_node to at most 4" in msg
    assert "add GPU nodes" in can_ever_fit(job("j", 0), [])
    plan = admit(total, [job("big", 1.0, nodes=3, priority=9), job("next", 2.0)], cluster_total=total)
    assert started(plan) == ["next"] and plan.never_fit[0][0].id == "big" and "can never start" in plan.never_fit[0][1]


def test_random_queues_respect_capacity_gangs_and_order():
    rng = random.Random(0)
    for _ in range(300):
        free = [rng.randint(0, 8) for _ in range(rng.randint(1, 6))]
        jobs = [job(f"j{i}", rng.random(), rng.randint(1, 3), rng.choice([1, 2, 4]), rng.randint(0, 2))
                for i in range(rng.randint(1, 8))]
        plan = admit(free, jobs)
        used = [0] * len(free)
        for a in plan.start:
            assert len(set(a.nodes)) == a.job.num_nodes  # the whole gang, on distinct nodes
            for node in a.nodes:
                used[node] += a.job.gpus_per_node
        assert all(u <= f for u, f in zip(used, free)) and plan.free == {i: f - u for i, (f, u) in
                                                                         enumerate(zip(free, used))}
        order = [j.id for j in queue_order(jobs)]
        assert started(plan) == order[: len(plan.start)]  # strict order: the started jobs are a prefix
