"""`raytron serve` killed with SIGKILL mid-job and started again on the same data dir."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.helpers.server import Server, job_losses, pid_alive, tiny, wait_for

pytestmark = pytest.mark.procs  # a real server process (and its job runners)


def test_sigkill_mid_job_then_restart_the_job_finishes_with_its_history_once(tmp_path):
    srv = Server(tmp_path / "data").start()
    with srv.client() as api:
        job_id = api.post("/jobs", json=tiny("survivor", world=2, iters=150)).json()["id"]
        wait_for(api, job_id, ("STARTING", "RUNNING"))
    srv.stop(signal.SIGKILL)
    runner = json.loads((srv.data_dir / "jobs" / job_id / "runner.json").read_text())["pid"]
    assert pid_alive(runner)  # the runner outlives the server (its own session)

    again = Server(srv.data_dir)
    again.port, again.url = srv.port, srv.url  # same address, as a restarted service
    again.start()
    try:
        with again.client() as api:
            assert api.get(f"/jobs/{job_id}").json()["state"] in ("STARTING", "RUNNING")  # re-attached, not FAILED
            job = wait_for(api, job_id, ("SUCCEEDED", "FAILED", "CANCELLED"), timeout_s=180)
            assert job["state"] == "SUCCEEDED", job
            losses = job_losses(api, job_id)
            assert len(losses) == 150
            events = api.get(f"/jobs/{job_id}/events").json()["events"]
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
            assert [e["state"] for e in events if e["kind"] == "state"] == ["QUEUED", "STARTING", "RUNNING",
                                                                            "SUCCEEDED"]
            assert [e["data"]["iteration"] for e in events if e["kind"] == "iteration"] == list(range(1, 151))
            assert sum(e["kind"] == "admission" for e in events) == 1  # not launched a second time
            # the restarted server admits new work once the survivor's slots are free
            nxt = api.post("/jobs", json=tiny("next", world=2, iters=1)).json()["id"]
            assert wait_for(api, nxt, ("SUCCEEDED", "FAILED"))["state"] == "SUCCEEDED"
    finally:
        again.stop()
        again.kill_runners()


def test_a_runner_gone_with_the_server_is_started_again_and_the_job_goes_on(tmp_path):
    """The server and the job's runner both die (the machine rebooted, say); a server started again
    starts a new runner, which goes on from the job's record: one restart, resumed from the last
    recorded checkpoint, the curve whole and equal to an undisturbed run's."""
    from tests.helpers.drills import undisturbed

    s = {**tiny("orphan", world=1, iters=40), "checkpoint": {"save_interval": 5}}
    srv = Server(tmp_path / "data").start()
    with srv.client() as api:
        job_id = api.post("/jobs", json=s).json()["id"]
        deadline = time.monotonic() + 120
        while (api.get(f"/jobs/{job_id}").json().get("iteration") or 0) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    srv.stop(signal.SIGKILL)
    runner = json.loads((srv.data_dir / "jobs" / job_id / "runner.json").read_text())["pid"]
    os.killpg(runner, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(runner) and time.monotonic() < deadline:
        time.sleep(0.05)
    expected = undisturbed(s)
    again = Server(srv.data_dir).start()
    try:
        with again.client() as api:
            job = wait_for(api, job_id, ("SUCCEEDED", "FAILED", "CANCELLED"), timeout_s=180)
            assert job["state"] == "SUCCEEDED", job  # mutation: recover() skipped -> stays RUNNING forever
            losses = job_losses(api, job_id)
            assert job["restarts"] == 1 and len(losses) == 40
            assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-6, (losses, expected)
            events = api.get(f"/jobs/{job_id}/events").json()["events"]
            assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
            started = [e for e in events if e["kind"] == "runner"]
            assert len(started) == 1 and started[0]["data"]["reason"] == "runner_vanished"
            assert "gone" in started[0]["message"]
    finally:
        again.stop()
        again.kill_runners()


def test_sigterm_stops_the_server_promptly_with_streams_open(tmp_path):
    import threading

    import httpx

    srv = Server(tmp_path / "data").start()
    try:
        with srv.client() as api:
            job_id = api.post("/jobs", json=tiny("streamed", world=1, iters=10 ** 6)).json()["id"]

            def listen():
                try:
                    with api.stream("GET", f"/jobs/{job_id}/events", headers={"Accept": "text/event-stream"},
                                    timeout=60) as r:
                        for _ in r.iter_lines():
                            pass
                except httpx.HTTPError:
                    pass

            threading.Thread(target=listen, daemon=True).start()
            wait_for(api, job_id, ("STARTING", "RUNNING"))
            t0 = time.monotonic()
            srv.stop(signal.SIGTERM)  # mutation: no graceful-shutdown timeout -> waits for the stream forever
            assert time.monotonic() - t0 < 15 and srv.proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises it
    finally:
        srv.stop(signal.SIGKILL)
        srv.kill_runners()
