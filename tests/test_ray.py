"""Jobs on Ray: placement, parity with the process launcher, teardown, failures, the CLI.

One simulated cluster (4 nodes x 2 GPU slots, CPU/gloo) is shared by the module; each Ray job
starts its own rank actors, so worlds stay small (2-8 ranks) and models tiny. The controller's
state machine is also stepped against a fake rank group, without Ray, in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from service.controller import (Decision, FailFast, InsufficientResources, JobController, JobState, RankDied,
                                RankRaised, RestartUpTo)
from service.placement import check_tp_in_node, plan_placement
from service.spec import parse_spec, to_job_config
from workers.grid import ParallelGrid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=256, seq_length=32)


def spec_dict(*, tp=2, pp=2, order="tp-cp-ep-dp-pp", nodes=4, gpus=2, iters=2, gbs=8) -> dict:
    return {"name": "raytest", "model": MODEL,
            "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "order": order},
            "training": {"train_iters": iters, "global_batch_size": gbs, "micro_batch_size": 2},
            "resources": {"num_nodes": nodes, "gpus_per_node": gpus}}


def make_job(**kw):
    job = to_job_config(parse_spec(spec_dict(**kw)))
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    return job, grid, plan_placement(grid, job.gpus_per_node, job.num_nodes)


# -- the state machine against a fake rank group (no Ray) -------------------------------------------

class FakeGroup:
    """Ranks that return a loss per iteration, or fail at a given call."""

    def __init__(self, world: int, fail_on_call: int | None = None):
        self.world, self.fail_on_call, self.calls, self.shut = world, fail_on_call, 0, False

    def start(self, faults):
        return [{"rank": r, "node_id": f"n{r // 2}", "pid": 100 + r, "tp": r % 2, "pp": 0, "dp": r // 2, "cp": 0,
                 "ep": 0} for r in range(self.world)]

    def run(self, iterations):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RankDied(1, {"node": 0, "node_id": "n0", "pid": 101}, "actor died")
        return [[{"loss": 1.0 / self.calls, "iteration": self.calls}] * iterations for _ in range(self.world)]

    def shutdown(self):
        self.shut = True

    def kill(self):
        pass


def test_controller_states_and_events_without_ray():
    job, grid, _ = make_job(tp=2, pp=1, nodes=2, gpus=2, iters=3)
    groups, events = [], []
    ctrl = JobController(job, grid, job_id="j1", on_event=events.append,
                         make_group=lambda attempt: groups.append(FakeGroup(4)) or groups[-1])
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED" and result["losses"] == [1.0, 0.5, 1.0 / 3]
    states = [e.state for e in events if e.kind == "state"]
    assert states == [JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED]
    assert [e.kind for e in events].count("iteration") == 3 and groups[0].shut
    assert all(a.time <= b.time for a, b in zip(events, events[1:]))
    assert JobState.SUCCEEDED.is_terminal and not JobState.RESTARTING.is_terminal
    assert JobState.RESTARTING.needs_new_attempt and json.dumps([e.to_dict() for e in events])


def test_controller_failure_policy_decides_without_ray():
    job, grid, _ = make_job(tp=2, pp=1, nodes=2, gpus=2, iters=3)
    assert FailFast().decide(RankDied(0, {}, "x"), 0) is Decision.FAIL
    groups = []

    def make(attempt):
        groups.append(FakeGroup(4, fail_on_call=2 if attempt == 0 else None))
        return groups[-1]

    ctrl = JobController(job, grid, job_id="j2", make_group=make, failure_policy=RestartUpTo(1))
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1 and len(result["losses"]) == 3
    assert [g.shut for g in groups] == [True, True]
    assert JobState.RESTARTING in [e.state for e in ctrl.events]

    failed = JobController(job, grid, job_id="j3", make_group=lambda a: FakeGroup(4, fail_on_call=1)).run()
    assert failed["state"] == "FAILED" and "rank 1" in failed["error"] and "n0" in failed["error"]


def test_controller_cancel_without_ray():
    job, grid, _ = make_job(tp=2, pp=1, nodes=2, gpus=2, iters=5)
    group = FakeGroup(4)
    ctrl = JobController(job, grid, job_id="j4", make_group=lambda a: group,
                         on_event=lambda e: e.kind == "iteration" and ctrl.cancel("user asked"))
    result = ctrl.run()
    assert result["state"] == "CANCELLED" and result["iterations"] == 1 and group.shut
    assert ctrl.events[-1].message == "user asked"


def test_root_cause_is_the_rank_that_broke_not_its_peers():
    from service.ray_launcher import _is_root_cause

    assert _is_root_cause(RankDied(3, {}, "The actor died unexpectedly"))
    assert _is_root_cause(RankRaised(1, {}, "InjectedFault: rank 1: injected fault before iteration 2"))
    assert not _is_root_cause(RankRaised(2, {}, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1"))


# -- on a simulated Ray cluster -------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    from service.ray_cluster import simulated_cluster

    with simulated_cluster(4, 2) as session:
        yield session


def leftovers() -> tuple[list, list]:
    """raytron actors still alive and raytron placement groups not removed."""
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_actors

    actors = [a.name for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
              if (a.name or "").startswith("raytron:")]
    groups = [g["name"] for g in placement_group_table().values()
              if g["name"].startswith("raytron:") and g["state"] != "REMOVED"]
    return actors, groups


def run_job(job, grid, plan, **kw):
    from service.controller import ControllerConfig
    from service.ray_launcher import run_on_ray

    config = kw.pop("config", ControllerConfig(placement_timeout_s=30))
    result = run_on_ray(job, grid, plan, config=config, **kw)
    assert leftovers() == ([], [])
    return result


@pytest.fixture(scope="module")
def ray_runs(cluster):
    """8 ranks (tp 2, pp 2, dp 2) on 4 nodes x 2 slots, for a non-default and the default order."""
    out = {}
    for order in ("dp-tp-pp", "tp-cp-ep-dp-pp"):
        job, grid, plan = make_job(order=order)
        out[order] = (job, grid, run_job(job, grid, plan))
    return out


@pytest.mark.ray
@pytest.mark.parametrize("order", ["dp-tp-pp", "tp-cp-ep-dp-pp"])
def test_tp_groups_share_a_ray_node(ray_runs, order):
    import ray

    job, grid, result = ray_runs[order]
    assert result["state"] == "SUCCEEDED" and result["iterations"] == 2
    placement = result["placement"]
    assert [p["rank"] for p in placement] == list(range(8))
    node_of = {p["rank"]: p["node_id"] for p in placement}
    assert set(node_of.values()) <= {n["NodeID"] for n in ray.nodes()}  # real Ray node ids
    assert len(set(node_of.values())) == 4 and len({p["pid"] for p in placement}) == 8
    assert check_tp_in_node(grid, node_of) == []
    for p in placement:  # the rank comes from the plan, whatever order the actors started in
        assert {k: p[k] for k in ("tp", "pp", "dp", "cp", "ep")} == {k: grid.coords(p["rank"])[k]
                                                                    for k in ("tp", "pp", "dp", "cp", "ep")}
    if order == "dp-tp-pp":
        assert grid.groups("tp")[0] == [0, 2] and node_of[0] == node_of[2] != node_of[1]


@pytest.mark.ray
def test_ray_and_process_launchers_give_the_same_losses(ray_runs):
    from service.runner import run_processes

    job, grid, on_ray = ray_runs["dp-tp-pp"]
    local = run_processes(job, grid)
    assert local["losses"] == pytest.approx(on_ray["losses"], rel=1e-6)
    # Contract 2: another order is another layout of the same math.
    assert ray_runs["tp-cp-ep-dp-pp"][2]["losses"] == pytest.approx(on_ray["losses"], rel=1e-4)


@pytest.mark.ray
@pytest.mark.parametrize("static", [True, False])
def test_job_that_cannot_fit_fails_with_the_numbers(cluster, static):
    from service.controller import ControllerConfig

    job, grid, plan = make_job(tp=2, pp=1, nodes=2, gpus=4)  # nodes here have 2 GPU slots
    events = []
    config = ControllerConfig(placement_timeout_s=2, static_cluster=static)
    result = run_job(job, grid, plan, config=config, on_event=events.append)
    assert result["state"] == "FAILED" and result["iterations"] == 0
    msg = result["error"]
    assert "needs 2 distinct node(s) with 4 GPU(s)" in msg and "4 node(s) with GPUs [2, 2, 2, 2]" in msg
    assert ("no node can join" if static else "waited 2s") in msg
    failure = [e for e in events if e.kind == "failure"][0]
    assert failure.data["code"] == InsufficientResources.code


@pytest.mark.ray
@pytest.mark.parametrize("kind,error", [("raise", RankRaised), ("exit", RankDied)])
def test_rank_failure_fails_the_job_naming_the_rank(cluster, kind, error):
    job, grid, plan = make_job(tp=2, pp=1, nodes=1, gpus=2, iters=3, gbs=4)
    seen = {}

    def hook(ctrl):
        ctrl.inject_fault(1, iteration=2, kind=kind)
        seen["ctrl"] = ctrl

    result = run_job(job, grid, plan, controller_hook=hook)
    ctrl = seen["ctrl"]
    assert result["state"] == "FAILED" and ctrl.state is JobState.FAILED and len(result["losses"]) == 1
    assert isinstance(ctrl.error, error) and ctrl.error.rank == 1
    assert ctrl.error.where["node_id"] == result["placement"][1]["node_id"]
    assert result["error"].startswith("rank 1 (")


@pytest.mark.ray
def test_cli_run_simulated_prints_the_result_json(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tp=1, pp=2, nodes=2, gpus=1, iters=2, gbs=4)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "api.cli", "run", str(spec), "--simulate", "2x4", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state"] == "SUCCEEDED" and result["iterations"] == 2 and result["world_size"] == 2
    assert set(result) >= {"job_id", "losses", "restarts", "sizes", "placement"}
    assert len({p["node_id"] for p in result["placement"]}) == 2  # STRICT_SPREAD: one node per bundle
