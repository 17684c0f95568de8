"""Jobs on Ray: placement, parity with the process launcher, teardown, failures, the CLI.

One simulated cluster (4 nodes x 2 GPU slots, CPU/gloo) is shared by the module; each Ray job
starts its own rank actors, so worlds stay small (2-8 ranks) and models tiny. The controller's
state machine against a fake group is in test_controller.py; the fault drills on local
processes in test_process_launcher.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from service.control.errors import InsufficientResources, RankDied, RankHung, RankRaised
from service.control.events import JobState
from service.spec.placement import check_tp_in_node
from service.spec.spec import parse_spec, to_job_config
from workers.rank.faults import Fault
from workers.grid import ParallelGrid

pytestmark = pytest.mark.ray

from tests.helpers.paths import ROOT_DIR as ROOT
from tests.helpers.leftovers import leftovers  # noqa: F401
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=256, seq_length=32)


def spec_dict(*, tp=2, pp=2, order="tp-cp-ep-dp-pp", nodes=4, gpus=2, iters=2, gbs=8, max_restarts=0,
              timeout=300) -> dict:
    return {"name": "raytest", "model": MODEL,
            "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "order": order},
            "training": {"train_iters": iters, "global_batch_size": gbs, "micro_batch_size": 2},
            "resources": {"num_nodes": nodes, "gpus_per_node": gpus},
            "fault_tolerance": {"max_restarts": max_restarts, "collective_timeout_s": timeout}}


def make_job(**kw):
    job = to_job_config(parse_spec(spec_dict(**kw)))
    return job, ParallelGrid.from_config(job.parallel, job.world_size)


# -- on a simulated Ray cluster -------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    from service.ranks.ray_cluster import simulated_cluster

    with simulated_cluster(4, 2) as session:
        yield session


def run_job(job, session, *, config=None, faults=(), on_event=None):
    """One job through the one orchestration path, on the module's Ray session."""
    from service.control.rank_group import LauncherConfig
    from service.control.jobs import start_job
    from service.ranks.ray_launcher import RayLauncher

    launcher = RayLauncher(session, config or LauncherConfig(placement_timeout_s=30))
    ctrl = start_job(job, launcher=launcher, on_event=on_event, faults=list(faults), background=False)
    result = ctrl.run()
    assert leftovers() == ([], [])
    return result, ctrl


@pytest.fixture(scope="module")
def ray_runs(cluster):
    """8 ranks (tp 2, pp 2, dp 2) on 4 nodes x 2 slots, for a non-default and the default order."""
    out = {}
    for order in ("dp-tp-pp", "tp-cp-ep-dp-pp"):
        job, grid = make_job(order=order)
        out[order] = (job, grid, run_job(job, cluster)[0])
    return out


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


def test_ray_and_process_launchers_give_the_same_losses(ray_runs):
    from service.control.jobs import start_job
    from service.ranks.process_launcher import ProcessLauncher

    job, grid, on_ray = ray_runs["dp-tp-pp"]
    local = start_job(job, launcher=ProcessLauncher(), background=False).run()
    assert local["losses"] == pytest.approx(on_ray["losses"], rel=1e-6)
    # Contract 2: another order is another layout of the same math.
    assert ray_runs["tp-cp-ep-dp-pp"][2]["losses"] == pytest.approx(on_ray["losses"], rel=1e-4)


@pytest.mark.parametrize("static", [True, False])
def test_job_that_cannot_fit_fails_with_the_numbers(cluster, static):
    from service.control.rank_group import LauncherConfig

    job, grid = make_job(tp=2, pp=1, nodes=2, gpus=4, max_restarts=3)  # nodes here have 2 GPU slots
    events = []
    config = LauncherConfig(placement_timeout_s=2, static_cluster=static)
    result, _ = run_job(job, cluster, config=config, on_event=events.append)
    assert result["state"] == "FAILED" and result["iterations"] == 0
    msg = result["error"]
    assert "needs 2 distinct node(s) with 4 GPU(s)" in msg and "4 node(s) with GPUs [2, 2, 2, 2]" in msg
    assert ("no node can join" if static else "waited 2s") in msg
    failure = [e for e in events if e.kind == "failure"][0]
    assert failure.data["code"] == InsufficientResources.code and result["restarts"] == 0  # not a rank failure


@pytest.mark.parametrize("kind,error", [("raise", RankRaised), ("exit", RankDied)])
def test_rank_failure_fails_the_job_naming_the_rank(cluster, kind, error):
    job, grid = make_job(tp=2, pp=1, nodes=1, gpus=2, iters=3, gbs=4)
    result, ctrl = run_job(job, cluster, faults=[Fault(1, 2, kind)])
    assert result["state"] == "FAILED" and ctrl.state is JobState.FAILED and len(result["losses"]) == 1
    assert isinstance(ctrl.error, error) and ctrl.error.rank == 1
    assert ctrl.error.where["node_id"] == result["placement"][1]["node_id"]
    assert ctrl.error.where["tp"] == 1 and ctrl.error.where["pp"] == 0
    assert result["error"].startswith("rank 1 (")


def test_restart_after_exit_and_hang_gives_the_undisturbed_curve(cluster):
    """Two drills in one job: rank 1 dies before iteration 2, then rank 2 hangs before iteration 3
    of the second attempt (the collective timeout and the progress watch catch it). The undisturbed
    curve is the job's on local processes (forked from a forkserver with torch imported: cheaper
    than four more rank actors; the launchers agree to 1e-6, test_ray_and_process_launchers_give_the_same_losses)."""
    from tests.helpers.drills import undisturbed

    s = spec_dict(tp=2, pp=2, nodes=2, gpus=2, iters=3, gbs=4, max_restarts=2, timeout=5)
    job = to_job_config(parse_spec(s))
    events = []
    result, ctrl = run_job(job, cluster, faults=[Fault(1, 2, "exit"), Fault(2, 3, "hang")], on_event=events.append)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 2
    assert result["losses"] == pytest.approx(undisturbed(s), rel=1e-6)
    failures = [e.data for e in events if e.kind == "failure"]
    assert [(f["code"], f["rank"]) for f in failures] == [(RankDied.code, 1), (RankHung.code, 2)]
    assert failures[1]["group"] == "pp" and failures[1]["pp"] == 1


@pytest.fixture(scope="module")
def tp2_dp2_curve(cluster) -> list[float]:
    """The undisturbed losses of the restart drills' job (tp 2 x dp 2 on 2 nodes, 3 iterations), once."""
    job, _ = make_job(tp=2, pp=1, nodes=2, gpus=2, iters=3, gbs=4, max_restarts=1)
    return run_job(job, cluster)[0]["losses"]


@pytest.mark.parametrize("kind", ["exit", "raise"])
def test_a_restart_starts_again_on_the_ranks_that_survived(cluster, tp2_dp2_curve, kind):
    """After rank 1 dies (or raises), the second attempt takes over the other ranks' actors: same
    processes (reset, no new torch import), a new actor only for a dead rank, the same curve.
    tp 2 x dp 2: rank 2 waits in a dp all-reduce for rank 0, which failed in a tp all-reduce with
    rank 1; only rank 0 freeing its groups at once (not at the 300 s timeout) lets rank 2 go in time."""
    from service.control.rank_group import LauncherConfig

    job, grid = make_job(tp=2, pp=1, nodes=2, gpus=2, iters=3, gbs=4, max_restarts=1)
    events = []
    # A wide reuse window (the cascade takes about a second) keeps the test deterministic on a
    # loaded machine; without the cascade rank 2 would wait for the 300 s collective timeout.
    config = LauncherConfig(placement_timeout_s=30, reuse_wait_s=60)
    result, _ = run_job(job, cluster, config=config, faults=[Fault(1, 2, kind)], on_event=events.append)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1
    assert result["losses"] == tp2_dp2_curve
    first, second = [e.data["placement"] for e in events if e.kind == "placement"]
    survived = [r != 1 or kind == "raise" for r in range(4)]
    assert [p["reused"] for p in first] == [False] * 4 and [p["reused"] for p in second] == survived
    assert [a["pid"] == b["pid"] for a, b in zip(first, second)] == survived


def _exported(job_id: str) -> dict:
    """Every node's Prometheus export (Ray's metrics agent): (metric, rank) -> (tags, value) of
    this job's raytron gauges."""
    import re
    import urllib.request

    import ray

    out = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            m = re.match(r'^ray_(raytron_\w+)\{(.*)\} (\S+)$', line)
            if m:
                tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
                if tags.get("job_id") == job_id:
                    out[(m.group(1), int(tags["rank"]))] = (tags, float(m.group(3)))
    return out


def test_rank_metrics_reach_the_ray_metrics_export_with_their_coordinates(cluster):
    """What the Ray dashboard's Grafana reads: each rank's gauges, tagged with job, rank and grid
    coordinates, holding this job's numbers (each the value of one of its iterations)."""
    s = spec_dict(tp=2, pp=1, nodes=1, gpus=2, iters=4, gbs=4)
    s["training"].update(split="90,10,0", eval_interval=2, eval_iters=1)
    job = to_job_config(parse_spec(s))
    result, ctrl = run_job(job, cluster)
    assert result["state"] == "SUCCEEDED"
    job_id = ctrl.job_id
    per_iteration = {key: {m[key] for m in ctrl.metrics if m.get(key) is not None}
                     for key in ("loss", "val_loss", "lr", "grad_norm", "loss_scale")}
    names = {"loss": "raytron_lm_loss", "val_loss": "raytron_val_loss", "lr": "raytron_lr",
             "grad_norm": "raytron_grad_norm", "loss_scale": "raytron_loss_scale"}
    wanted = {(name, rank) for name in [*names.values(), "raytron_tokens_per_s", "raytron_step_time_s",
                                        "raytron_peak_mem_mb"] for rank in (0, 1)}
    deadline = time.monotonic() + 60  # the agent exports what the workers reported, every few seconds
    while not wanted <= set(got := _exported(job_id)) and time.monotonic() < deadline:
        time.sleep(1)
    assert wanted <= set(got), sorted(wanted - set(got))
    for rank in (0, 1):
        coords = ParallelGrid.from_config(job.parallel, 2).coords(rank)
        for (name, r), (tags, value) in got.items():
            if r == rank:
                assert {k: tags[k] for k in ("tp", "pp", "dp", "cp", "ep")} == {k: str(coords[k]) for k in
                                                                                   ("tp", "pp", "dp", "cp", "ep")}
        for key, name in names.items():
            assert got[(name, rank)][1] in per_iteration[key], (name, got[(name, rank)], per_iteration[key])
        assert got[("raytron_tokens_per_s", rank)][1] > 0 and got[("raytron_peak_mem_mb", rank)][1] > 0


def test_a_sigterm_to_a_rank_actor_saves_the_current_iteration_and_moves_off_its_node(cluster, tp2_dp2_curve):
    """SIGTERM to rank 3's actor process (a cloud's preemption signal to a worker process) with
    sigterm_grace_s 20: the actor lives on (Ray's own handler would exit it: a rank failure), every
    rank saves the iteration it finished, the driver asks Ray to drain the node, and the job goes on
    from that iteration on other nodes: one PREEMPTED event naming the signalled rank, no failure,
    restarts 0, the undisturbed curve. Runs after the module's other jobs: the drained node, idle
    once the job left it, leaves the cluster."""
    s = spec_dict(tp=2, pp=1, nodes=2, gpus=2, iters=3, gbs=4, max_restarts=0)
    s["fault_tolerance"]["sigterm_grace_s"] = 20
    job = to_job_config(parse_spec(s))
    events, sent, drained = [], {}, {}

    def signal_rank_3(event):
        from service.ranks.ray_drain import draining_nodes

        events.append(event)
        if event.kind == "iteration" and sent:
            drained.update(draining_nodes())  # asked for by the driver in the call that took the notice
        if event.kind == "iteration" and event.data["iteration"] == 1 and not sent:
            victim = next(e for e in events if e.kind == "placement").data["placement"][3]
            sent.update(victim, time=time.time())
            os.kill(victim["pid"], signal.SIGTERM)

    result, ctrl = run_job(job, cluster, on_event=signal_rank_3)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 0 and not [e for e in events if e.kind == "failure"]
    assert result["losses"] == pytest.approx(tp2_dp2_curve, rel=1e-6)
    (pre,) = [e for e in events if e.kind == "preempted"]
    at = events.index(pre)
    before = [e.data["iteration"] for e in events[:at] if e.kind == "iteration"]
    after = [e.data["iteration"] for e in events[at:] if e.kind == "iteration"]
    assert pre.data["signalled"] == [3] and pre.data["nodes"] == [sent["node_id"]] and 3 in pre.data["ranks"]
    assert pre.data["iteration"] == before[-1] and after == list(range(before[-1] + 1, 4)), (before, after)
    assert sent["time"] + 20 - 1 < pre.data["deadline"] <= time.time() + 20 and pre.data["before_deadline_s"] > 0
    print(pre.message)  # the save's time and its margin to the deadline (with -s)
    second = [e for e in events if e.kind == "placement"][-1].data["placement"]
    assert drained.get(sent["node_id"]) == pytest.approx(pre.data["deadline"], abs=0.01)  # Ray drains the node
    assert sent["node_id"] not in {p["node_id"] for p in second}  # so nothing new is placed there


def test_cli_run_simulated_restarts_after_a_fault(tmp_path):
    from tests.helpers.drills import run_locally

    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tp=1, pp=2, nodes=2, gpus=1, iters=3, gbs=4, max_restarts=1)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "api.cli.main", "run", str(spec), "--simulate", "2x4", "--json",
                           "--fault", "1@2:exit"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state"] == "SUCCEEDED" and result["iterations"] == 3 and result["world_size"] == 2
    assert result["restarts"] == 1 and "rank 1 (node 1" in proc.stderr and "died" in proc.stderr
    assert set(result) >= {"job_id", "losses", "restarts", "sizes", "placement"}
    assert len({p["node_id"] for p in result["placement"]}) == 2  # STRICT_SPREAD: one node per bundle
    assert "Unhandled error" not in proc.stderr  # the peers' failed calls were read, not left to Ray's logger
    # the undisturbed curve: what `raytron run --launcher processes --json` prints, in this process
    local = run_locally(spec_dict(tp=1, pp=2, nodes=2, gpus=1, iters=3, gbs=4, max_restarts=1))
    assert local["losses"] == pytest.approx(result["losses"], rel=1e-6)


def test_sigterm_cancels_a_ray_run_and_stops_the_cluster(tmp_path):
    import signal
    import time
    import uuid

    spec = tmp_path / "long.yaml"
    spec.write_text(yaml.safe_dump(spec_dict(tp=1, pp=2, nodes=2, gpus=1, iters=1000, gbs=4)))
    tag = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAYTRON_TEST_TAG": tag}
    err = tmp_path / "err.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "api.cli.main", "run", str(spec), "--simulate", "2x1"], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        deadline = time.monotonic() + 240
        while "node_id" not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)  # the placement table: the actors are up
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, err.read_text()[-3000:]
    assert "CANCELLED" in out and "(cancelled by SIGTERM)" in out and len(out.splitlines()) == 1
    assert "Traceback" not in err.read_text() and "SIGTERM" not in err.read_text()  # no Ray stack dump
    survivors = []
    for _ in range(50):
        survivors = [p for p in os.listdir("/proc") if p.isdigit() and _has_tag(p, tag)]
        if not survivors:
            break
        time.sleep(0.2)
    assert survivors == []  # no rank actor, raylet, GCS or dashboard process left


def _has_tag(pid: str, tag: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"RAYTRON_TEST_TAG={tag}".encode() in f.read()
    except OSError:
        return False
