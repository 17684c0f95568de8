"""Issue 11's elastic drill on a real Ray cluster, both ways: a node lost for good (its raylet
killed) shrinks dp after ``node_grace_s``; a node that joins later grows the job back at its next
checkpoint. The same curve as an undisturbed run, two resize events, the full placement at the end.
(The same steps against a fake rank group: test_elastic.py; the shrink alone through the
server: test_serve_faults.py.)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from service.control.events import JobState
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.drills import MODEL, _raylet_of, close, undisturbed

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# 3 nodes x 1 slot, tp 1: dp 3 -> 2 -> 3 (the global batch 6 divides by both); a checkpoint every
# 2 iterations; the node is lost in iteration 4, so the shrunk attempt resumes at 2 and grows back
# after its checkpoint at 4, with iterations 5..8 left for the grown one.
SPEC = {"name": "regrow", "model": MODEL, "parallel": {"tensor_model_parallel_size": 1},
        "training": {"train_iters": 8, "global_batch_size": 6, "micro_batch_size": 1, "lr": 3e-3},
        "checkpoint": {"save_interval": 2},
        "resources": {"num_nodes": 3, "gpus_per_node": 1, "min_nodes": 1},
        "fault_tolerance": {"max_restarts": 2, "collective_timeout_s": 60, "node_grace_s": 2.0}}


def _wait_dead(node_id: str, timeout_s: float = 30) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
        assert time.monotonic() < deadline, f"Ray still reports node {node_id} alive"
        time.sleep(0.2)


def test_lost_node_shrinks_then_the_job_grows_back_when_a_node_joins(tmp_path):
    import ray

    from service.control.jobs import start_job
    from service.ranks.ray_cluster import simulated_cluster
    from service.ranks.ray_launcher import RayLauncher
    from tests.helpers.leftovers import leftovers

    job = to_job_config(parse_spec(SPEC))
    events, lost, added, sizes = [], [], [], []

    with simulated_cluster(3, 1, growable=True) as session:
        assert not session.static
        head = ray.get_runtime_context().get_node_id()

        def on_event(e):
            events.append(e)
            if e.kind == "state" and e.state is JobState.STARTING:
                sizes.append(e.data["num_nodes"])
            elif e.kind == "iteration" and e.data["iteration"] == 3 and not lost:
                # A node lost for good: SIGKILL of the raylet of the last rank's node (never the
                # head, where this driver is). Its rank's process outlives a raylet killed alone
                # until Ray declares the node dead (~3 s; a lost machine takes it at once), and
                # 8 iterations take ~1 s: wait for that, so the next iteration is the one that fails.
                placement = next(x for x in reversed(events) if x.kind == "placement").data["placement"]
                victim = next(p["node_id"] for p in reversed(placement) if p["node_id"] != head)
                raylet, is_head = _raylet_of(victim)
                assert not is_head
                os.kill(raylet, signal.SIGKILL)
                lost.append(victim)
                _wait_dead(victim)
            elif e.kind == "state" and e.state is JobState.RUNNING and sizes[-1] < 3 and not added:
                added.append(session.add_node())  # the shrunk attempt runs: a node joins

        # One iteration per call: the drill acts on iteration 3's event before iteration 4 runs
        # (with calls of a second of iterations, the event would come after the save of 4).
        launcher = RayLauncher(session)
        launcher.config = replace(launcher.config, call_target_s=0.0)
        ctrl = start_job(job, launcher=launcher, on_event=on_event, background=False,
                         checkpoint_root=str(tmp_path))
        result = ctrl.run()
        assert leftovers() == ([], [])
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    failures = [e.data for e in events if e.kind == "failure"]
    assert result["state"] == "SUCCEEDED", (result, failures)
    assert lost and added and added[0] in alive and lost[0] not in alive
    # shrink (a rank of the lost node failed; 2 nodes are left: dp 2 divides the batch 6), then grow
    resizes = [e for e in events if e.kind == "resize"]
    assert [(r.data["old"]["sizes"]["dp"], r.data["new"]["sizes"]["dp"]) for r in resizes] == [(3, 2), (2, 3)]
    assert [(r.data["old"]["num_nodes"], r.data["new"]["num_nodes"]) for r in resizes] == [(3, 2), (2, 3)]
    assert resizes[0].message.startswith("dp 3 -> 2") and resizes[1].message.startswith("dp 2 -> 3")
    assert sizes[0] == 3 and sizes[-2:] == [2, 3], sizes
    grow = [e for e in events if e.kind == "state" and e.state is JobState.RESTARTING and "growing back" in e.message]
    assert len(grow) == 1 and grow[0].data["resize"] is True and "iteration 4" in grow[0].message, grow
    starts = [e.data for e in events if e.kind == "state" and e.state is JobState.STARTING]
    assert starts[-1]["from_checkpoint"].endswith("iter_0000004") and starts[-1]["sizes"]["dp"] == 3, starts
    assert events.index(resizes[0]) < events.index(grow[0]) < events.index(resizes[1])
    # the lost node is named; growing back is not a restart
    assert any(f.get("node_id") == lost[0] for f in failures), failures
    assert result["restarts"] == 1 and result["sizes"]["dp"] == 3 and result["world_size"] == 3
    # the grown attempt's placement: every rank, one per node, the joined node among them
    placement = result["placement"]
    assert [p["rank"] for p in placement] == [0, 1, 2]
    nodes = {p["node_id"] for p in placement}
    assert len(nodes) == 3 and added[0] in nodes and lost[0] not in nodes
    # the global batch stayed 6 throughout: the curve of an undisturbed run, each iteration once
    expected = undisturbed(SPEC)
    assert len(result["losses"]) == 8 and close(result["losses"], expected), (result["losses"], expected)
