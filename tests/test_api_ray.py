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
from tests.test_api import tiny

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
        assert [n.gpus for n in view.nodes()] == [2]
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
