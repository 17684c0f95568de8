"""`raytron serve` killed and started again on the path `make run` takes (jobs as Ray Jobs), on
a simulated cluster it owns and on an outside one (`RAY_ADDRESS`), each on a cluster of its own:
the job must end SUCCEEDED on the curve of an undisturbed run under the runner it had, with every
event once. The runner killed and a node lost are drills on the shared cluster of
test_serve_faults.py.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from service.ranks.proc_tree import marked
from service.ranks.ray_cluster import CLUSTER_MARK
from tests.helpers.server import Server, job_losses, wait_for
from tests.helpers.drills import (DONE, close, failures, processes_named, spec, story, submit, undisturbed,
                                  wait_iteration, whole_and_once)

pytestmark = pytest.mark.ray


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
    log = whole_and_once(api, job_id)
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
        expected = undisturbed(s, one_rank=True)
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
        expected = undisturbed(s, one_rank=True)
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
