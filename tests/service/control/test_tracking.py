"""Experiment tracking (service/control/tracking.py) against a real MLflow server on 127.0.0.1 that the
session starts (SQLite backend), read back with MlflowClient: ``raytron run`` with a rank killed
mid-job logs one run whose loss history is the job's curve (no step twice, though the restarted
attempt ran some iterations again), with the spec as parameters, the restart among the event tags and
the run FINISHED. W&B in offline mode, read back from the run's ``.wandb`` file with wandb's own
protobuf records (tests/helpers/wandb_runs.py): one run directory across the rank kill, its history
the job's losses at every iteration, the spec as its config, the events in its summary (one job,
tracked by both at once). A tracker that cannot be reached (MLflow at a port nothing listens on, W&B
online without an API key) does not fail the job, and its event says so."""

import json
import os
import subprocess

import pytest
import yaml

from tests.helpers.cli import RAYTRON
from tests.helpers.parity import tiny_spec

pytestmark = pytest.mark.procs


def _spec(tmp_path, uri, iters=5, tracking=None):
    spec = tiny_spec(world=2, parallel={"pipeline_model_parallel_size": 2}, training={"train_iters": iters})
    spec["fault_tolerance"] = {"max_restarts": 1, "collective_timeout_s": 20}
    spec["checkpoint"] = {"save_interval": 2, "dir": str(tmp_path / "ckpt")}
    spec["tracking"] = tracking or {"mlflow": {"tracking_uri": uri, "experiment": "tracking-test"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(path, *extra, env=None):
    p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json", *extra],
                       capture_output=True, text=True, timeout=300, env=env)
    return p, json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, mlflow_uri):
    """One ``raytron run`` with rank 1 killed at iteration 4, tracked in MLflow and in W&B offline at
    once (each tracker has its own delivery; the two tests below read one each): (CLI output, the
    MLflow URI, where W&B wrote)."""
    tmp_path = tmp_path_factory.mktemp("tracked")
    home = tmp_path / "wandb-home"  # nothing of wandb's outside the test's folder, nothing to the network
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home / "config"),
               WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"), WANDB_DIR=str(home))
    where = tmp_path / "runs"
    tracking = {"mlflow": {"tracking_uri": mlflow_uri, "experiment": "tracking-test"},
                "wandb": {"project": "tracking-test", "mode": "offline", "dir": str(where)}}
    p, out = _run(_spec(tmp_path, mlflow_uri, tracking=tracking), "--fault", "1@4:exit", env=env)
    assert p.returncode == 0 and out["restarts"] == 1, p.stderr
    return p, out, mlflow_uri, where


def test_one_mlflow_run_per_job_holds_its_curve_across_a_rank_kill(tracked):
    from mlflow.tracking import MlflowClient

    p, out, mlflow_uri, _ = tracked
    assert f"MLflow at {mlflow_uri}: created run" in p.stderr
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("tracking-test")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`raytron.job_id` = '{out['job_id']}'")
    assert len(runs) == 1
    run = client.get_run(runs[0].info.run_id)
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert [s for s, _ in history] == [1, 2, 3, 4, 5]  # iteration 3 ran twice, logged once
    assert all(abs(v - want) <= 1e-6 * abs(want) for (_, v), want in zip(history, out["losses"]))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lr")] == [1, 2, 3, 4, 5]
    assert run.data.params["model.hidden_size"] == "32" and run.data.params["parallel.pipeline_model_parallel_size"] == "2"
    assert run.info.status == "FINISHED"
    events = [v for k, v in run.data.tags.items() if k.startswith("raytron.event.")]
    assert any("restart" in e.lower() for e in events) and any("SUCCEEDED" in e or "succeeded" in e for e in events)


def test_an_unreachable_tracker_does_not_fail_the_job(tmp_path):
    from tests.helpers.mlflow_server import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # and W&B online without an API key (a HOME and config dir of the test's own): it cannot log in
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_SILENT="true")
    # What is undelivered at the end is dropped after 1 s, not the default 10 s: the same events, sooner.
    env["RAYTRON_TRACKING_CLOSE_GRACE_S"] = "1"
    tracking = {"mlflow": {"tracking_uri": uri}, "wandb": {"project": "p", "mode": "online", "dir": str(tmp_path)}}
    p, out = _run(_spec(tmp_path, uri, iters=2, tracking=tracking), env=env)
    assert p.returncode == 0 and out["state"] == "SUCCEEDED", p.stderr
    assert f"MLflow at {uri} is unreachable" in p.stderr and "the job goes on" in p.stderr
    assert "W&B project p (online) is unreachable (UsageError" in p.stderr
    assert "deliveries not made before the job ended" in p.stderr


def test_one_wandb_offline_run_per_job_holds_its_curve_across_a_rank_kill(tracked):
    from tests.helpers.wandb_runs import read_run, run_dirs

    p, out, _, where = tracked
    assert "W&B project tracking-test (offline): created run" in p.stderr
    (run_dir,) = run_dirs(where)  # one run directory, though two attempts ran
    run = read_run(run_dir)
    assert run["id"] == out["job_id"] and run["exit_code"] == 0
    steps = sorted(run["history"])
    assert steps == [1, 2, 3, 4, 5]  # iteration 3 ran twice, logged once
    assert all(abs(run["history"][s]["loss"] - want) <= 1e-6 * abs(want) for s, want in zip(steps, out["losses"]))
    assert all("lr" in run["history"][s] for s in steps)
    assert run["config"]["model"]["hidden_size"] == 32 and run["config"]["parallel"]["pipeline_model_parallel_size"] == 2
    events = [v for k, v in run["summary"].items() if k.startswith("raytron.event.")]
    assert any("restart" in e.lower() for e in events) and any("SUCCEEDED" in e for e in events)


def test_the_close_grace_is_ten_seconds_or_what_the_environment_says_and_a_bad_value_is_refused(monkeypatch):
    from service.control.tracking import close_grace_s

    monkeypatch.delenv("RAYTRON_TRACKING_CLOSE_GRACE_S", raising=False)
    assert close_grace_s() == 10.0
    monkeypatch.setenv("RAYTRON_TRACKING_CLOSE_GRACE_S", "1.5")
    assert close_grace_s() == 1.5
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv("RAYTRON_TRACKING_CLOSE_GRACE_S", bad)
        with pytest.raises(ValueError, match=f"RAYTRON_TRACKING_CLOSE_GRACE_S='{bad}' is no number of seconds"):
            close_grace_s()
