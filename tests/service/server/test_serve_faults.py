"""Fault drills through `raytron serve --simulate 4x2 --launcher ray` (issue 11's acceptance):
a real server, jobs as Ray Jobs, ranks as Ray actors on a simulated 4-node cluster that the
tests share. Each drill breaks a running job from outside (kill -9 and then SIGSTOP of a rank in
one job, the job's runner killed, a raylet killed) or from inside (a crash while saving, through
`serve --fault`; exhausted restarts); the job must end as stated, with the loss curve of an
undisturbed run (computed here on local processes, on one rank where the curves are compared at
1e-5: layout invariance) and events that tell what happened. The lost-node and drain drills run last: each leaves the cluster a node short.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import pytest

from tests.helpers.server import Server, job_losses, wait_for
from tests.helpers.drills import (DONE, _raylet_of, close, events, failures, processes_named, ray_server_client,
                                  spec, story, submit, undisturbed, wait_iteration, whole_and_once)

pytestmark = pytest.mark.ray


def rank_record(api, job_id: str, rank: int) -> dict:
    ranks = api.get(f"/jobs/{job_id}/placement").json()["ranks"]
    return next(r for r in ranks if r["rank"] == rank)


# Rank 3 dies writing the checkpoint of iteration 9 (after its data file, before its record). The
# server gives this drill to every job (``serve --fault``); it fires only in a job of 4 ranks or more
# that saves at iteration 9: the crash-in-save job saves every 3, the module's other jobs every 2.
SAVE_DRILL = "3@9:save"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The module's server and its client (one simulated 4x2 cluster for every drill)."""
    yield from ray_server_client(tmp_path_factory, "serve4x2", extra_args=("--fault", SAVE_DRILL), with_server=True)


@pytest.fixture(scope="module")
def api(served):
    return served[1]


def wait_failure(api, job_id: str, timeout_s: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = failures(api, job_id)
        if found:
            return found
        state = api.get(f"/jobs/{job_id}").json()["state"]
        assert state not in DONE, f"job {job_id} ended {state} without a failure (did the drill reach it?)"
        time.sleep(0.05)
    raise AssertionError(f"job {job_id}: no failure after {timeout_s}s")


def test_crash_in_the_middle_of_a_save_restarts_from_the_previous_complete_checkpoint(served):
    srv, api = served
    s = spec("ckptcrash", save_interval=3)  # 2 nodes x 2 slots, tp 2 (dp 2), 12 iterations, a checkpoint every 3
    job_id = submit(api, s)
    root = srv.data_dir / "checkpoints" / job_id
    wait_failure(api, job_id)
    # What the crash left (before the next attempt's commits prune it): the save of iteration 9
    # in its temporary directory with rank 3's data file but not its record, and no manifest;
    # the checkpoint of iteration 6 complete.
    names = sorted(os.listdir(root))
    tmp = [n for n in names if n.startswith(".iter_0000009.tmp-")]
    assert "iter_0000006" in names and "iter_0000009" not in names and len(tmp) == 1, names
    left = set(os.listdir(root / tmp[0]))
    assert "rank_00003.bin" in left and "rank_00003.json" not in left and "manifest.json" not in left, left
    assert "manifest.json" in os.listdir(root / "iter_0000006")
    expected = undisturbed(s, one_rank=True)
    job = wait_for(api, job_id, DONE, timeout_s=300)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    assert job["restarts"] == 1  # the drill fires once
    losses = job_losses(api, job_id)
    assert close(losses, expected), (losses, expected)
    named = [f for f in failures(api, job_id) if f.get("rank") == 3]
    assert named and named[0]["code"] == "rank_died" and "died" in named[0]["message"], failures(api, job_id)
    froms = [a["from_checkpoint"] for a in job["attempts"]]
    assert len(froms) == 2 and froms[0] is None and froms[1].endswith(f"/{job_id}/iter_0000006"), froms
    log = events(api, job_id)
    placements = [e["data"]["placement"] for e in log if e["kind"] == "placement"]
    assert {(r["resumed_iteration"], os.path.basename(r["resumed_from"])) for r in placements[1]} == \
        {(6, "iter_0000006")}, placements[1]  # every rank of attempt 2 loaded iteration 6
    its = [e["data"]["iteration"] for e in log if e["kind"] == "iteration"]
    assert its == [*range(1, 9), *range(7, 13)], its  # 7 and 8 ran again after the checkpoint of 6
    # the half-written save never became a checkpoint: only complete ones remain, leftovers pruned
    assert sorted(os.listdir(root)) == ["iter_0000009", "iter_0000012"], os.listdir(root)


def signal_rank(api, job_id: str, rank: int, sig: int) -> dict:
    """Send ``sig`` to rank ``rank``'s process; returns its placement record (pid, node)."""
    victim = rank_record(api, job_id, rank)
    os.kill(victim["pid"], sig)
    return victim


def test_kill_9_then_sigstop_of_a_rank_restart_from_the_checkpoint(api):
    """One job, two drills: rank 3 killed with SIGKILL at iteration 4 (its death is named and the
    next attempt resumes from a checkpoint), then, once that attempt is past iteration 8, rank 1
    stopped with SIGSTOP (only the collective timeout, 10 s here, catches it: named as hung). The
    job ends SUCCEEDED after a restart for each (at least) on the undisturbed curve."""
    s = spec("kill9-sigstop", timeout=10)
    job_id = submit(api, s)
    wait_iteration(api, job_id, 4)
    killed = signal_rank(api, job_id, 3, signal.SIGKILL)
    expected = undisturbed(s, one_rank=True)
    deadline = time.monotonic() + 240
    while (job := api.get(f"/jobs/{job_id}").json())["restarts"] < 1 or job["state"] != "RUNNING" \
            or (job.get("iteration") or 0) < 8:
        assert job["state"] not in DONE and time.monotonic() < deadline, (job, failures(api, job_id))
        time.sleep(0.05)
    stopped = signal_rank(api, job_id, 1, signal.SIGSTOP)
    job = wait_for(api, job_id, DONE, timeout_s=300)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    # at least one restart per drill, as each drill alone asserted (the pair has taken three on a
    # loaded 2-core VM; the failures say which)
    assert job["restarts"] >= 2, (job["restarts"], failures(api, job_id))
    losses = job_losses(api, job_id)
    assert close(losses, expected), story(api, job_id, losses, expected)
    named = [f for f in failures(api, job_id) if f.get("rank") == 3]
    assert named and named[0].get("node_id") == killed["node_id"] and "died" in named[0]["message"], failures(api, job_id)
    attempts = job["attempts"]
    assert attempts[1]["from_checkpoint"] and "iter_" in attempts[1]["from_checkpoint"], attempts
    hung = [f for f in failures(api, job_id) if f.get("code") == "rank_hung"]
    assert hung and hung[0]["rank"] == 1 and hung[0]["node_id"] == stopped["node_id"], failures(api, job_id)


def test_max_restarts_exhausted_fails_with_the_reason(api):
    job_id = submit(api, spec("norestart", max_restarts=0))
    wait_iteration(api, job_id, 2)
    os.kill(rank_record(api, job_id, 2)["pid"], signal.SIGKILL)
    job = wait_for(api, job_id, DONE, timeout_s=120)
    assert job["state"] == "FAILED" and job["restarts"] == 0
    assert job["error"]["code"] == "rank_died" and "rank 2" in job["error"]["message"], job["error"]


def runner_killed_at(api, s: dict, iteration: int) -> tuple[str, dict, list[float]]:
    """Submit ``s``, SIGKILL its runner once it reaches ``iteration``, wait for the end: the job id,
    the job and its losses, after checking it SUCCEEDED on the undisturbed curve."""
    job_id = submit(api, s)
    wait_iteration(api, job_id, iteration)
    runners = processes_named("python", "-m", "service.server.job_main", job_id)
    assert len(runners) == 1, runners
    os.kill(runners[0], signal.SIGKILL)
    expected = undisturbed(s, one_rank=True)
    job = wait_for(api, job_id, DONE, timeout_s=300)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    losses = job_losses(api, job_id)
    assert close(losses, expected), story(api, job_id, losses, expected)
    return job_id, job, losses


def test_a_killed_runner_is_started_again_and_goes_on_from_the_record(api, tmp_path, mlflow_uri):
    """A chat fine-tuning job on the serve path (streamed records, Llama-3 template, packed rows),
    tracked in the session's real ``mlflow server`` on 127.0.0.1; its runner (the Ray Job's entry
    point) SIGKILLed at iteration 6: the scheduler starts a new runner (a Ray Job of its own), which replays
    the job's events and resumes from the last recorded checkpoint at the next unseen row: one
    restart, the undisturbed curve. The MLflow run is the same one under both runners, its loss
    history the job's curve, each step once. (A runner killed in a job without chat data: the
    chaos drill, tests/test_chaos.py.)"""
    from mlflow.tracking import MlflowClient

    from tests.helpers.chat import CONVERSATIONS, chat_tokenizer, write_jsonl
    uri = mlflow_uri
    iters = 12
    s = spec("runnerkill", nodes=2, gpus=2, tp=2, iters=iters)
    s["model"] = {**s["model"], "vocab_size": 320}
    records = [{"messages": c} for c in CONVERSATIONS] * 30
    s["training"].update({"chat_data": write_jsonl(tmp_path / "chat.jsonl", records),
                          "chat_tokenizer": chat_tokenizer(tmp_path / "tok", "llama3"), "chat_streaming": True})
    s["tracking"] = {"mlflow": {"tracking_uri": uri}}
    job_id, job, losses = runner_killed_at(api, s, 6)
    assert len(losses) == iters
    log = whole_and_once(api, job_id)
    started = [e for e in log if e["kind"] == "runner"]
    assert len(started) == 1 and started[0]["data"]["reason"] == "runner_exited", started
    assert job["restarts"] == 1 and job["ray_job_id"].endswith(f"{job_id}-2")
    froms = [a["from_checkpoint"] for a in job["attempts"]]
    assert len(froms) == 2 and froms[1] and "iter_" in froms[1], froms
    opened = [e["data"] for e in log if e["kind"] == "tracking" and "run_id" in e["data"]]
    assert [o["resumed"] for o in opened] == [False, True] and opened[0]["run_id"] == opened[1]["run_id"], opened
    client = MlflowClient(uri)
    # The tracker delivers in the background, in order: the run ends FINISHED after the last metrics,
    # a moment after the job's final event.
    deadline = time.monotonic() + 30
    while client.get_run(opened[0]["run_id"]).info.status != "FINISHED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert client.get_run(opened[0]["run_id"]).info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(opened[0]["run_id"], "loss"))
    assert [step for step, _ in history] == list(range(1, iters + 1))
    assert close([v for _, v in history], losses)


def test_a_lost_node_shrinks_dp_with_the_same_global_batch_and_curve_under_the_same_runner(api):
    """A worker node's raylet killed (4x2, tp2 x dp4, 24 iterations, a checkpoint every 2,
    min_nodes 2 below num_nodes 4): the runner lives on the head node, so the job shrinks to dp 2
    with the same global batch, under the same runner, and finishes on the same curve with every
    event once. Runs last: the cluster stays a node short."""
    s = spec("lostnode", nodes=4, gpus=2, tp=2, gbs=8, iters=24, min_nodes=2, grace=5.0)
    job_id = submit(api, s)
    wait_iteration(api, job_id, 4)
    victim = rank_record(api, job_id, 7)
    raylet, head = _raylet_of(victim["node_id"])
    assert not head  # the head holds no ranks
    os.kill(raylet, signal.SIGKILL)
    expected = undisturbed(s, one_rank=True)
    job = wait_for(api, job_id, DONE, timeout_s=400)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    assert job["sizes"]["dp"] == 2 and job["sizes"]["tp"] == 2  # 3 nodes left: dp 3 does not divide 8
    assert job["spec"]["training"]["global_batch_size"] == 8
    losses = job_losses(api, job_id)
    assert close(losses, expected), story(api, job_id, losses, expected)
    log = whole_and_once(api, job_id)
    resize = [e for e in log if e["kind"] == "resize"]
    assert resize and resize[0]["data"]["old"]["sizes"]["dp"] == 4 and resize[0]["data"]["new"]["sizes"]["dp"] == 2
    assert len(api.get(f"/jobs/{job_id}/placement").json()["ranks"]) == 4
    assert any(f.get("node_id") == victim["node_id"] for f in failures(api, job_id)), failures(api, job_id)
    assert [e for e in log if e["kind"] == "runner"] == []  # the runner lived on


def test_a_drained_node_is_left_with_a_checkpoint_of_the_current_iteration_before_the_deadline(api):
    """`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 10` (a
    preemption notice) on a node holding ranks of a job without periodic checkpoints: every rank
    saves the iteration it finished, committed before the deadline; the job leaves the node (Ray
    places nothing new on it) for the free node, goes on from that iteration (none run twice) on the
    undisturbed curve, and records one PREEMPTED event; with max_restarts 0 it still SUCCEEDS and
    `restarts` stays 0. Runs after the lost-node drill: 3 nodes, the job on 2 of them; the drained
    node, idle once the job left, leaves the cluster."""
    s = spec("drain", nodes=2, gpus=2, tp=2, iters=36, save_interval=None, max_restarts=0)
    job_id = submit(api, s)
    wait_iteration(api, job_id, 1)
    victim = rank_record(api, job_id, 3)
    address = api.get("/cluster").json()["ray_address"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "drain-node", "--address", address,
                           "--node-id", victim["node_id"], "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                           "--reason-message", "raytron test: a spot preemption", "--deadline-remaining-seconds", "10"],
                          env=env, capture_output=True, text=True, timeout=120)
    sent = time.time()  # the CLI set the deadline before it returned: at most sent + 10
    assert done.returncode == 0, done.stderr[-2000:]
    job = wait_for(api, job_id, DONE, timeout_s=300)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    assert job["restarts"] == 0 and failures(api, job_id) == []
    expected = undisturbed(s)
    losses = job_losses(api, job_id)
    assert close(losses, expected, rel=1e-6), story(api, job_id, losses, expected)
    log = whole_and_once(api, job_id)
    at = [i for i, e in enumerate(log) if e["kind"] == "preempted"]
    assert len(at) == 1, [e["message"] for e in log if e["kind"] != "iteration"]
    pre = log[at[0]]["data"]
    print(log[at[0]]["message"])  # the save's time and its margin to the deadline (with -s)
    assert pre["nodes"] == [victim["node_id"]] and 3 in pre["ranks"], pre
    before = [e["data"]["iteration"] for e in log[:at[0]] if e["kind"] == "iteration"]
    after = [e["data"]["iteration"] for e in log[at[0]:] if e["kind"] == "iteration"]
    assert pre["iteration"] == before[-1] < 36 and after == list(range(before[-1] + 1, 37)), (before, after)
    manifest = json.loads((Path(pre["checkpoint"]) / "manifest.json").read_text())
    assert manifest["iteration"] == pre["iteration"]
    assert manifest["created_unix"] < pre["saved_time"] < pre["deadline"] <= sent + 10, (manifest["created_unix"], pre)
    assert job["attempts"][1]["from_checkpoint"] == pre["checkpoint"]
    placed = api.get(f"/jobs/{job_id}/placement").json()["ranks"]
    assert victim["node_id"] not in {r["node_id"] for r in placed} and len(placed) == 4
