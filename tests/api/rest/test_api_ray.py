"""Jobs as Ray Jobs on a simulated one-node Ray cluster: the scheduler admits against Ray's nodes,
the runner is a Ray Job (listed by the dashboard's own jobs API), cancel stops it."""

from __future__ import annotations

import time

import httpx
import pytest

from service.ranks.ray_cluster import simulated_cluster
from service.server.ray_jobs import RayClusterView, RayJobsRunners, submission_id
from service.server.scheduler import Scheduler
from service.spec.spec import parse_spec
from service.server.store import TERMINAL_STATES, JobStore, sqlite_url
from tests.helpers.server import tiny

pytestmark = pytest.mark.ray


def _wait(store, job_id, states, timeout_s=300):  # generous: the machine is shared
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = store.get_job(job_id)
        if job["state"] in states:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job['state']}: {store.events(job_id)}")


def test_jobs_run_as_ray_jobs(tmp_path):
    store = JobStore(sqlite_url(tmp_path))
    with simulated_cluster(1, 2) as session:
        view = RayClusterView(session.address, session.dashboard_url)
        assert [(n.gpus, n.accelerator) for n in view.nodes()] == [(2, None)]  # no GPU label on CPU
        launcher = RayJobsRunners(tmp_path, sqlite_url(tmp_path), store, session.dashboard_url)
        sched = Scheduler(store, launcher, view, poll_s=0.2)
        sched.start()
        try:
            done = sched.submit(parse_spec({k: v for k, v in tiny("onray", world=2, iters=2).items()}))["id"]
            job = _wait(store, done, TERMINAL_STATES)
            assert job["state"] == "SUCCEEDED", store.events(done)
            assert job["ray_job_id"] == submission_id(done)  # mutation: ray_job_id not recorded -> None
            deadline = time.monotonic() + 30
            while launcher.is_alive(done) and time.monotonic() < deadline:  # the runner exits after its last event
                time.sleep(0.2)
            listed = httpx.get(f"{session.dashboard_url}/api/jobs/").json()
            ours = [j for j in listed if j.get("submission_id") == submission_id(done)]
            assert ours and ours[0]["status"] == "SUCCEEDED" and ours[0]["metadata"]["raytron_job_id"] == done
            assert "iteration 2 loss" in (tmp_path / "jobs" / done / "driver.log").read_text()

            long = sched.submit(parse_spec(tiny("long", world=2, iters=10 ** 6)))["id"]
            _wait(store, long, ("RUNNING",))
            sched.cancel(long)
            job = _wait(store, long, TERMINAL_STATES, timeout_s=60)
            assert job["state"] == "CANCELLED"
            deadline = time.monotonic() + 30
            while launcher.is_alive(long) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert launcher.client.get_job_status(submission_id(long)).value == "STOPPED"
        finally:
            sched.stop()
    store.close()


def test_a_spec_naming_no_accelerator_is_planned_with_the_one_the_cluster_reports(tmp_path):
    """Issue 23: the cluster figures default to what Ray reports. The worker node carries Ray's
    label of an H100 (``accelerator_type:H100``, as Ray sets it on such a machine); a real server
    on that cluster shows it (GET /cluster), plans a spec without accelerator fields on the H100's
    figures, and stores the submitted spec with ``gpu_type: H100``; a spec with figures of its own
    keeps them. Breaks if the label is not read, or not applied, or applied over the spec's own."""
    from tests.helpers.hosted_cluster import HostedCluster
    from tests.helpers.server import TOKEN, Server

    cluster = HostedCluster(tmp_path, nodes=1, gpus=2, accelerator="H100")
    srv = Server(tmp_path / "data", simulate=None, launcher="ray", env=cluster.env(), start_timeout_s=180)
    try:
        srv.start()
        with srv.client(TOKEN) as c:
            info = c.get("/cluster").json()
            assert info.get("gpu_type") == "H100" and [n["accelerator"] for n in info["nodes"]] == ["H100"], info
            spec = tiny("typed", world=2, iters=2)
            assert "gpu_type" not in spec["resources"]
            plan = c.post("/plan", json=spec).json()
            assert plan["cost"]["cluster"]["name"] == "H100", plan["cost"]["cluster"]
            own = {**spec, "resources": {**spec["resources"], "gpu_memory_gb": 40}}
            assert c.post("/plan", json=own).json()["cost"]["cluster"]["name"] == "simulated-cpu (as given)"
            job = c.post("/jobs", json=spec).json()
            assert job["spec"]["resources"]["gpu_type"] == "H100", job["spec"]
            c.post(f"/jobs/{job['id']}/cancel")
    finally:
        srv.stop()
        srv.kill_runners()
        cluster.close()
