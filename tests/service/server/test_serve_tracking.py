"""The server's trackers (``raytron serve --tracking-mlflow-uri ... --tracking-wandb-project ...``) on
the served path, against a real ``mlflow server`` on 127.0.0.1 and W&B in offline mode: a job whose
spec has no ``tracking`` section gets them; with a rank killed mid-job and the server SIGKILLed and
started again while the job runs, it has one MLflow run and one W&B run directory, each with the
job's curve as its loss history, each iteration once. A spec with ``tracking: {}`` opts out; a
spec's own section wins over the server's."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.drills import spec, submit, wait_iteration
from tests.helpers.server import Server, job_losses, wait_for

pytestmark = pytest.mark.procs


def _runs(client, experiment: str, job_id: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`raytron.job_id` = '{job_id}'")


def test_server_trackers_log_a_job_across_a_rank_kill_and_a_server_restart(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    from tests.helpers.wandb_runs import read_run, run_dirs

    uri = mlflow_uri  # the session's server: this test's experiments are "served" and "own"
    runs = tmp_path / "wandb"
    flags = ("--tracking-mlflow-uri", uri, "--tracking-mlflow-experiment", "served", "--tracking-wandb-project",
             "served", "--tracking-wandb-mode", "offline", "--tracking-wandb-dir", str(runs), "--fault", "1@3:exit")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # nothing to the network
    env.update(WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    srv = Server(tmp_path / "serve", simulate="1x2", extra_args=flags, env=env).start()
    again = None
    try:
        with srv.client() as api:
            job_id = submit(api, spec("served", nodes=1, gpus=2, tp=1, iters=30, gbs=4, max_restarts=1, timeout=30))
            own = submit(api, {**spec("own", nodes=1, gpus=2, tp=1, iters=2, gbs=4),
                               "tracking": {"mlflow": {"tracking_uri": uri, "experiment": "own"}}})
            off = submit(api, {**spec("off", nodes=1, gpus=2, tp=1, iters=2, gbs=4), "tracking": {}})
            wait_iteration(api, job_id, 6, timeout_s=120)  # past the rank kill at 3
        srv.stop(signal.SIGKILL)
        time.sleep(1.0)  # the job runs on without a server
        again = Server(srv.data_dir, simulate="1x2", extra_args=flags, env=env)
        again.port, again.url = srv.port, srv.url
        again.start()
        with again.client() as api:
            job = wait_for(api, job_id, ("SUCCEEDED", "FAILED", "CANCELLED"), timeout_s=180)
            assert job["state"] == "SUCCEEDED" and job["restarts"] == 1, job
            losses = job_losses(api, job_id)
            for other in (own, off):
                assert wait_for(api, other, ("SUCCEEDED", "FAILED", "CANCELLED"), timeout_s=120)["state"] == "SUCCEEDED"
            off_events = api.get(f"/jobs/{off}/events").json()["events"]
        assert len(losses) == 30
        client = MlflowClient(uri)
        (run,) = _runs(client, "served", job_id)  # one run, through the rank kill and the server restart
        deadline = time.monotonic() + 30  # the runner delivers in the background, then ends the run
        while client.get_run(run.info.run_id).info.status != "FINISHED" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert client.get_run(run.info.run_id).info.status == "FINISHED"
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
        assert [s for s, _ in history] == list(range(1, 31))
        assert all(abs(v - want) <= 1e-6 * abs(want) for (_, v), want in zip(history, losses))
        assert len(_runs(client, "own", own)) == 1 and _runs(client, "served", own) == []  # its own section wins
        assert _runs(client, "served", off) == [] and not [e for e in off_events if e["kind"] == "tracking"]
        (run_dir,) = run_dirs(runs)  # the served job's only: "own" named MLflow alone, "off" nothing
        while (wandb_run := read_run(run_dir))["exit_code"] is None and time.monotonic() < deadline + 30:
            time.sleep(0.5)  # finished by the runner in the background
        assert wandb_run["exit_code"] == 0
        assert wandb_run["id"] == job_id and sorted(wandb_run["history"]) == list(range(1, 31))
        assert all(abs(wandb_run["history"][i + 1]["loss"] - want) <= 1e-6 * abs(want) for i, want in enumerate(losses))
    finally:
        for s in (again, srv):
            if s is not None:
                s.stop()
        srv.kill_runners()
