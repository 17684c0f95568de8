"""Failures outside the rank processes, on the path `make run` takes (`raytron serve --simulate`,
jobs as Ray Jobs): the server killed and started again, the job's runner killed, a node lost
while the job may shrink. Each job must end SUCCEEDED on the curve of an undisturbed run, with
every event once. The server restart runs first, on a cluster of its own; the lost node runs
last (the shared cluster stays a node short).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from service.ranks.proc_tree import marked, matching
from service.ranks.ray_cluster import CLUSTER_MARK
from tests.helpers.server import Server, job_losses, wait_for
from tests.helpers.drills import DONE, _raylet_of, close, events, failures, ray_server_client, spec, story, submit, undisturbed, wait_iteration

pytestmark = pytest.mark.ray


def processes_named(*argv_prefix: str) -> list[int]:
    """Pids whose argv starts with a program ending in ``argv_prefix[0]`` followed by the rest."""
    return matching(lambda argv: argv[0].endswith(argv_prefix[0])
                    and argv[1:len(argv_prefix)] == list(argv_prefix[1:]))


def whole_and_once(api, job_id: str, iters: int) -> list[dict]:
    log = events(api, job_id)
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    return log


def same_port(srv: Server, **kwargs) -> Server:
    """A server (not started) on ``srv``'s data dir and port: clients keep their URL."""
    again = Server(srv.data_dir, **kwargs)
    again.port, again.url = srv.port, srv.url
    return again


def finished_under_the_same_runner(api, job_id: str, expected: list[float], iters: int) -> dict:
    """The job SUCCEEDED under a server started again, on the undisturbed curve, with the runner it
    had: no new runner, no restart, one admission, every iteration and event once."""
    job = wait_for(api, job_id, DONE, timeout_s=300)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    losses = job_losses(api, job_id)
    assert close(losses, expected), story(api, job_id, losses, expected)
    log = whole_and_once(api, job_id, iters)
    assert [e for e in log if e["kind"] == "runner"] == [] and job["restarts"] == 0  # the runner lived on
    assert sum(e["kind"] == "admission" for e in log) == 1
    assert [e["data"]["iteration"] for e in log if e["kind"] == "iteration"] == list(range(1, iters + 1))
    return job


def test_server_killed_and_started_again_reattaches_to_its_simulated_cluster(tmp_path):
    """SIGKILL of `raytron serve --simulate` mid-job: the cluster and the job's runner (a Ray Job) live on;
    a server started again on the data dir re-attaches to both (no second cluster, no second runner)."""
    srv = Server(tmp_path / "data", simulate="2x2", launcher="ray", start_timeout_s=180).start()
    record = srv.data_dir / "ray_cluster.json"
    again = None
    try:
        with srv.client() as api:
            s = spec("reattach", nodes=2, gpus=2, tp=2, iters=24)
            job_id = submit(api, s)
            wait_iteration(api, job_id, 4)
        cluster_id = json.loads(record.read_text())["cluster_id"]
        srv.stop(signal.SIGKILL)
        assert processes_named("gcs_server") and marked(CLUSTER_MARK, cluster_id)  # the cluster outlives its server
        expected = undisturbed(s)
        again = same_port(srv, simulate="2x2", launcher="ray", start_timeout_s=180)
        again.start()
        assert "re-attached to the simulated Ray cluster" in again.log.read_text()
        assert json.loads(record.read_text())["cluster_id"] == cluster_id
        with again.client() as api:
            finished_under_the_same_runner(api, job_id, expected, 24)
        gcs = [p for p in processes_named("gcs_server") if p in marked(CLUSTER_MARK, cluster_id)]
        assert len(gcs) == 1  # one cluster, not a second one beside the first
        again.stop()
        deadline = time.monotonic() + 10
        while marked(CLUSTER_MARK, cluster_id) and time.monotonic() < deadline:  # the last ones on their way out
            time.sleep(0.2)
        assert marked(CLUSTER_MARK, cluster_id) == set() and not record.exists()  # stopped with the server
    finally:
        for server in (srv, again):
            if server is not None:
                server.stop(signal.SIGKILL)
                server.kill_runners()
        if record.exists():
            from service.ranks.ray_cluster import stop_marked_cluster

            data = json.loads(record.read_text())
            stop_marked_cluster(data["cluster_id"], data.get("temp_dir"), record)


def test_server_killed_and_started_again_reattaches_to_the_ray_jobs_of_an_outside_cluster(tmp_path):
    """`raytron serve` on a cluster it does not own (RAY_ADDRESS), SIGKILLed mid-job: the job's runner
    (a Ray Job) lives on; a server started again finds it by its submission id and re-attaches (no
    second runner, no restart, the curve whole, every event once). The cluster outlives both servers."""
    from tests.helpers.hosted_cluster import HostedCluster

    cluster = HostedCluster(tmp_path, nodes=2, gpus=2)
    srv = again = None
    try:
        srv = Server(tmp_path / "data", simulate=None, launcher="ray", start_timeout_s=180, env=cluster.env()).start()
        with srv.client() as api:
            s = spec("outside", nodes=2, gpus=2, tp=2, iters=24)
            job_id = submit(api, s)
            wait_iteration(api, job_id, 4)
        srv.stop(signal.SIGKILL)
        assert processes_named("python", "-m", "service.server.job_main", job_id)  # the runner lives on
        expected = undisturbed(s)
        again = same_port(srv, simulate=None, launcher="ray", start_timeout_s=180, env=cluster.env())
        again.start()
        with again.client() as api:
            job = finished_under_the_same_runner(api, job_id, expected, 24)
            assert job["ray_job_id"] == f"raytron-{job_id}"
        assert "re-attached to job" in again.log.read_text()
        again.stop()
        assert [p for p in processes_named("gcs_server") if p in cluster.processes()]  # not the server's to stop
    finally:
        for server in (srv, again):
            if server is not None:
                server.stop(signal.SIGKILL)
        cluster.close()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    yield from ray_server_client(tmp_path_factory, "survive4x2")


def runner_killed_at(api, s: dict, iteration: int) -> tuple[str, dict, list[float]]:
    """Submit ``s``, SIGKILL its runner once it reaches ``iteration``, wait for the end: the job id,
    the job and its losses, after checking it SUCCEEDED on the undisturbed curve."""
    job_id = submit(api, s)
    wait_iteration(api, job_id, iteration)
    runners = processes_named("python", "-m", "service.server.job_main", job_id)
    assert len(runners) == 1, runners
    os.kill(runners[0], signal.SIGKILL)
    expected = undisturbed(s)
    job = wait_for(api, job_id, DONE, timeout_s=300)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    losses = job_losses(api, job_id)
    assert close(losses, expected), story(api, job_id, losses, expected)
    return job_id, job, losses


def test_a_killed_runner_is_started_again_and_goes_on_from_the_record(api, tmp_path):
    """SIGKILL of the job's runner (the Ray Job's entry point) at iteration 6: the scheduler starts a
    new runner (a Ray Job of its own), which replays the job's events and resumes from the last
    recorded checkpoint: one restart, the curve whole. The job's MLflow run (a real ``mlflow server``
    on 127.0.0.1) is the same one under both runners, its loss history the job's curve, each step once."""
    from mlflow.tracking import MlflowClient

    from tests.helpers.mlflow_server import mlflow_server

    with mlflow_server(tmp_path) as uri:
        s = spec("runnerkill", nodes=2, gpus=2, tp=2, iters=20)
        s["tracking"] = {"mlflow": {"tracking_uri": uri}}
        job_id, job, losses = runner_killed_at(api, s, 6)
        log = whole_and_once(api, job_id, 20)
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
        assert [step for step, _ in history] == list(range(1, 21))
        assert close([v for _, v in history], losses)


def test_a_chat_job_whose_runner_is_killed_goes_on_at_the_next_unseen_row(api, tmp_path):
    """Chat fine-tuning on the serve path (streamed records, Llama-3 template, packed rows): the
    job's runner SIGKILLed at iteration 4; the new runner resumes from the last checkpoint at the next
    unseen row, and the curve is the undisturbed one."""
    from tests.helpers.chat import CONVERSATIONS, chat_tokenizer, write_jsonl

    s = spec("chatkill", nodes=2, gpus=2, tp=2, iters=10)
    s["model"] = {**s["model"], "vocab_size": 320}
    records = [{"messages": c} for c in CONVERSATIONS] * 20
    s["training"].update({"chat_data": write_jsonl(tmp_path / "chat.jsonl", records),
                          "chat_tokenizer": chat_tokenizer(tmp_path / "tok", "llama3"), "chat_streaming": True})
    _, job, losses = runner_killed_at(api, s, 4)
    assert job["restarts"] == 1 and len(losses) == 10


def test_a_lost_node_with_min_nodes_below_num_nodes_shrinks_and_the_job_finishes(api):
    """A worker node's raylet killed (4x2, tp2 x dp4, 40 iterations, a checkpoint every 2, min_nodes 2):
    the runner lives on the head node, so the job shrinks to dp 2 and finishes on the same curve.
    Runs last: the cluster stays a node short."""
    s = spec("lostnode", nodes=4, gpus=2, tp=2, gbs=8, iters=40, min_nodes=2, grace=5.0)
    job_id = submit(api, s)
    wait_iteration(api, job_id, 4)
    victim = next(r for r in api.get(f"/jobs/{job_id}/placement").json()["ranks"] if r["rank"] == 7)
    raylet, head = _raylet_of(victim["node_id"])
    assert not head  # the head holds no ranks
    os.kill(raylet, signal.SIGKILL)
    expected = undisturbed(s)
    job = wait_for(api, job_id, DONE, timeout_s=400)
    assert job["state"] == "SUCCEEDED", (job, failures(api, job_id))
    assert job["sizes"]["dp"] == 2 and job["sizes"]["tp"] == 2  # 3 nodes left: dp 3 does not divide 8
    losses = job_losses(api, job_id)
    assert close(losses, expected), story(api, job_id, losses, expected)
    whole_and_once(api, job_id, 40)
    assert [e for e in events(api, job_id) if e["kind"] == "runner"] == []  # the runner lived on
