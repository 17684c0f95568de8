"""A runner cut off from its Ray cluster exits within seconds with the reason, and a new runner goes on.

The decision (:meth:`ConnectionWatch.judge`) is tested on scripted probes; the probes and the
runner's exit against a real simulated cluster hosted by another process (as a cluster outlives
a runner; one for the module): its node's raylet killed (the job then goes on under a new runner,
on the curve of an undisturbed run), or, last, the GCS killed (the head node lost: nothing can go
on, but the runner says so at once instead of waiting out a 600 s rendezvous).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from service.ranks.proc_tree import matching
from service.ranks.ray_watch import ConnectionWatch, Probe
from service.server.job_main import EXIT_RAY_LOST
from service.server.runners import runner_command
from service.server.store import JobStore, sqlite_url
from tests.helpers.hosted_cluster import HostedCluster

from tests.helpers.paths import ROOT


# ---- the decision, on scripted probes ------------------------------------------------------------
def _judge_all(watch: ConnectionWatch, probes: list[tuple[float, Probe]]) -> list[str | None]:
    return [watch.judge(p, t) for t, p in probes]


def test_a_refused_raylet_socket_is_a_loss_only_when_confirmed():
    watch = ConnectionWatch(lambda r: None, raylet_probes=2)
    gone = Probe(raylet_gone=True, detail="Connection refused")
    assert _judge_all(watch, [(0, gone), (1, Probe()), (2, gone)]) == [None, None, None]  # never twice in a row
    reason = watch.judge(gone, 3)
    assert reason is not None and "raylet is gone" in reason and "Connection refused" in reason


def test_a_silent_gcs_is_a_loss_after_its_grace_and_an_answer_resets_the_clock():
    watch = ConnectionWatch(lambda r: None, gcs_grace_s=10)
    silent = Probe(gcs_answered=False, detail="Timed out while waiting for GCS")
    assert _judge_all(watch, [(0, silent), (9, silent), (9.5, Probe()), (10, silent), (19.9, silent)]) == [None] * 5
    reason = watch.judge(silent, 20)
    assert reason is not None and "has not answered for 10s" in reason and "Timed out" in reason


def test_a_node_the_gcs_declares_dead_is_a_loss_at_once():
    reason = ConnectionWatch(lambda r: None).judge(Probe(node_dead=True), 0)
    assert reason is not None and "reports this node" in reason and "dead" in reason


def test_the_watch_calls_on_lost_once_from_its_thread_and_stops():
    calls: list[str] = []
    probes = iter([Probe()] * 3 + [Probe(node_dead=True)] * 100)
    done = threading.Event()
    watch = ConnectionWatch(lambda r: (calls.append(r), done.set()), probe=lambda: next(probes), period_s=0.01)
    with watch:
        assert done.wait(10)
        time.sleep(0.1)  # a second call would land now
    assert len(calls) == 1 and watch.lost == calls[0]


# ---- against a real cluster -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hosted(tmp_path_factory):
    """One hosted cluster (2 worker nodes x 2 GPU slots) for the module's drills, in file order: the
    raylet drill takes one node, the stale runner's test needs one node, the GCS drill (last) takes
    the head. Its close checks that nothing of it is left."""
    cluster = HostedCluster(tmp_path_factory.mktemp("hosted"))
    try:
        yield cluster
    finally:
        cluster.close()


def _spec(iters: int) -> dict:
    return {"name": "cutoff",
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                      "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 16},
            "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-3, "seed": 7},
            "checkpoint": {"save_interval": 2, "keep_last": 3},
            "resources": {"num_nodes": 1, "gpus_per_node": 2},
            "fault_tolerance": {"max_restarts": 2, "collective_timeout_s": 60}}


def _wait_iteration(store: JobStore, job_id: str, at_least: int, runner: subprocess.Popen, timeout_s=240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(store.events(job_id, kind="iteration")) >= at_least:
            return
        assert runner.poll() is None, f"the runner exited with {runner.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach iteration {at_least}")


def _watched_raylet(log: Path) -> int:
    """The pid of the raylet the runner watches (it names the socket in its log)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"watching the Ray connection of node \S+ \(raylet socket (\S+),", log.read_text())
        if found:
            pids = matching(lambda argv: any(a == f"--raylet_socket_name={found.group(1)}" for a in argv))
            assert len(pids) == 1, pids
            return pids[0]
        time.sleep(0.2)
    raise AssertionError(f"the runner named no raylet: {log.read_text()[-3000:]}")


def _cut_off(tmp_path: Path, cluster: HostedCluster, store: JobStore, url: str, job_id: str, victim: str):
    """Start a runner of ``job_id`` on the cluster, kill ``victim`` (its raylet, or the GCS) at iteration 4;
    returns (seconds from the kill to the runner's exit, its exit status, its log)."""
    log = tmp_path / f"{job_id}-runner-1.log"
    with open(log, "w") as out:
        runner = subprocess.Popen(runner_command(job_id, tmp_path, url, launcher="ray"), cwd=ROOT,
                                  env=cluster.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_iteration(store, job_id, 4, runner)
        if victim == "raylet":
            pid = _watched_raylet(log)
        else:
            pid = next(p for p in matching(lambda argv: argv[0].endswith("gcs_server")) if p in cluster.processes())
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        status = runner.wait(120)
        took = time.monotonic() - t0
        print(f"{victim} killed: the runner exited {took:.1f}s later with status {status}")
        return took, status, log.read_text()
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()


@pytest.mark.ray
def test_a_runner_whose_raylet_dies_exits_at_once_and_a_new_runner_goes_on(tmp_path, hosted):
    """The runner's node's raylet killed at iteration 4: the runner exits within seconds with
    EXIT_RAY_LOST and the reason, recorded as a failure, the job not ended; a new runner (what the
    server starts then) finishes it on the undisturbed curve with one restart. Without the watch
    the runner lingers on a dead node (checked: it exits 0 here, its calls to the actors it already
    has still go through; any new actor or placement group, as a restart needs, waits out the 600 s
    rendezvous)."""
    from tests.helpers.drills import close, undisturbed

    spec = _spec(100)  # long enough not to end in the seconds the watch takes
    url = sqlite_url(tmp_path)
    store = JobStore(url)
    cluster = hosted
    try:
        store.create_job(spec, job_id="cutoff-1")
        took, status, log = _cut_off(tmp_path, cluster, store, url, "cutoff-1", "raylet")
        assert status == EXIT_RAY_LOST, log[-4000:]
        assert took < 30, took  # a 600 s rendezvous wait before the watch
        assert "the job's runner lost its Ray connection: " in log and "the node was lost" in log, log[-4000:]
        lost = [e for e in store.events("cutoff-1", kind="failure") if e["data"].get("code") == "ray_connection_lost"]
        assert len(lost) == 1, store.events("cutoff-1", kind="failure")
        assert store.get_job("cutoff-1")["state"] in ("RUNNING", "RESTARTING", "STARTING")

        again = subprocess.run(runner_command("cutoff-1", tmp_path, url, launcher="ray"), cwd=ROOT, env=cluster.env(),
                               capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-4000:]
        job = store.get_job("cutoff-1")
        assert job["state"] == "SUCCEEDED", job
        losses = [m["loss"] for m in store.metrics("cutoff-1")]
        assert close(losses, undisturbed(spec)), losses
        iterations = [e["data"]["iteration"] for e in store.events("cutoff-1", kind="iteration")]
        assert sorted(set(iterations)) == list(range(1, 101))
    finally:
        store.close()


STALE_RUNNER = """
import sys, ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from service.ranks.ray_cluster import NAMESPACE
from workers.rank.actor import actor_name
ray.init(namespace=NAMESPACE, logging_level="warning")
job = sys.argv[1]
pg = placement_group([{"GPU": 2, "CPU": 2}], strategy="PACK", name=f"raytron:{job}")
assert pg.wait(60)
@ray.remote(num_gpus=1, num_cpus=1)
class Idle:
    def ping(self):
        return "alive"
actor = Idle.options(name=actor_name(job, 0), scheduling_strategy=PlacementGroupSchedulingStrategy(
    placement_group=pg, placement_group_bundle_index=0)).remote()
ray.get(actor.ping.remote())
print("HELD", flush=True)
sys.stdin.read()
"""


@pytest.mark.ray
def test_a_new_runner_takes_over_what_an_earlier_runner_of_the_job_left_on_the_cluster(tmp_path, hosted):
    """A runner whose driver died holds its job's named placement group and rank actors until the
    GCS marks that driver dead, which may come after the next runner starts (seen in CI: the new
    runner FAILED with "placement group 'raytron:<job>' already exists"). Here a live driver holds
    both, as such a stale runner does; a new runner of the job removes them and finishes the job."""
    url = sqlite_url(tmp_path)
    store = JobStore(url)
    cluster = hosted
    stale = subprocess.Popen([sys.executable, "-c", STALE_RUNNER, "stale-1"], cwd=ROOT, env=cluster.env(), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert stale.stdout.readline().startswith("HELD")
        store.create_job(_spec(4), job_id="stale-1")
        run = subprocess.run(runner_command("stale-1", tmp_path, url, launcher="ray"), cwd=ROOT, env=cluster.env(),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-4000:]
        assert store.get_job("stale-1")["state"] == "SUCCEEDED"
        assert len(store.metrics("stale-1")) == 4
    finally:
        stale.kill()
        stale.wait()
        store.close()


@pytest.mark.ray
def test_a_runner_whose_gcs_is_gone_exits_within_seconds_with_the_reason(tmp_path, hosted):
    """The GCS killed (the head node lost) at iteration 4: the runner exits with EXIT_RAY_LOST after
    the GCS's grace (10 s), naming the GCS, and leaves the job to a new runner (not ended). Last in the module: the cluster's head is gone after it."""
    url = sqlite_url(tmp_path)
    store = JobStore(url)
    cluster = hosted
    try:
        store.create_job(_spec(400), job_id="headless-1")
        took, status, log = _cut_off(tmp_path, cluster, store, url, "headless-1", "gcs")
        assert status == EXIT_RAY_LOST, log[-4000:]
        assert took < 40, took  # Ray's own driver would retry the GCS for 60 s, then a rendezvous for 600 s
        assert re.search(r"the GCS at \S+ has not answered for \d+s", log), log[-4000:]
        lost = [e for e in store.events("headless-1", kind="failure") if e["data"].get("code") == "ray_connection_lost"]
        assert len(lost) == 1 and "the head node was lost" in lost[0]["message"], lost
        assert store.get_job("headless-1")["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED")
    finally:
        store.close()
