"""The experiment trackers' runs (MLflow, Weights & Biases): the back ends that
:mod:`service.control.tracking` delivers a job's events to.

Each run has the same five members, called from its tracker's one delivery thread, in order:
``where`` (the tracker, in words, for events), ``open()`` (find or create the job's run; a no-op once
open, else ``{"tracker", "run_id", "url", "resumed", ...}``), ``metrics(step, values)`` (a step at or
below the run's last one is skipped, so an iteration run again is not logged twice), ``note(key,
text)`` (a job event) and ``end(state)``. Any exception is the tracker failing: the delivery retries.
"""

from __future__ import annotations

import os
import re
import time

from service.control.events import JobState

END_STATUS = {JobState.SUCCEEDED.value: "FINISHED", JobState.FAILED.value: "FAILED",
              JobState.CANCELLED.value: "KILLED"}


def flat_params(spec: dict, prefix: str = "") -> dict[str, str]:
    """A spec as ``{"model.hidden_size": "64", ...}`` (None values left out)."""
    out = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, f"{name}."))
        elif value is not None:
            out[name] = str(value)[:500]
    return out


def wandb_run_id(job_id: str) -> str:
    """The job's W&B run id: its job id in the characters W&B takes (at most 64)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[:64]


def tracker_runs(spec: dict, job_id: str) -> list:
    """The runs a validated spec's ``tracking`` section asks for (none without one)."""
    from service.spec.tracking import TrackingSpec

    t = TrackingSpec.model_validate(spec.get("tracking") or {})
    body = {k: v for k, v in spec.items() if k != "tracking"}
    name = spec.get("name", "job")
    runs: list = []
    if t.mlflow is not None:
        runs.append(MLflowRun(t.mlflow.tracking_uri, t.mlflow.experiment, job_id, name, flat_params(body)))
    if t.wandb is not None and t.wandb.mode != "disabled":
        runs.append(WandbRun(t.wandb.model_dump(), job_id, name, body))
    return runs


class MLflowRun:
    """The job's MLflow run: found by its ``raytron.job_id`` tag or created; the spec's fields as its
    parameters, events as tags ``raytron.event.<ms>.<kind>``, ended FINISHED, FAILED or KILLED."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, job_id: str, job_name: str, params: dict[str, str]):
        self.uri, self.experiment = tracking_uri, experiment
        self.job_id, self.job_name, self.params = job_id, job_name, params
        self.client = self.run_id = None
        self.last_step = 0

    @property
    def where(self) -> str:
        return f"MLflow at {self.uri}"

    def open(self) -> dict | None:
        if self.run_id is not None:
            return None
        # One try per delivery: the background retry is ours, not the client's (minutes by default).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        found = client.search_runs([exp_id], filter_string=f"tags.`raytron.job_id` = '{self.job_id}'", max_results=1)
        if found:
            run_id = found[0].info.run_id
            self.last_step = max((m.step for m in client.get_metric_history(run_id, "loss")), default=0)
            client.update_run(run_id, status="RUNNING")
        else:
            run_id = client.create_run(exp_id, run_name=self.job_name, tags={"raytron.job_id": self.job_id}).info.run_id
            params = [Param(k, v) for k, v in sorted(self.params.items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                client.log_batch(run_id, params=params[i:i + 100])
        self.client, self.run_id = client, run_id
        url = f"{self.uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}" if self.uri.startswith("http") else None
        return {"tracker": self.name, "run_id": run_id, "experiment_id": exp_id, "url": url, "resumed": bool(found)}

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last_step:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])
        self.last_step = step

    def note(self, key: str, text: str) -> None:
        self.client.set_tag(self.run_id, key, text[:5000])

    def end(self, state: str) -> None:
        self.client.set_terminated(self.run_id, status=END_STATUS.get(state, "FINISHED"))


class WandbRun:
    """The job's W&B run: id :func:`wandb_run_id` of the job id with ``resume="allow"`` (an online run
    is resumed by any later runner; offline, each runner process writes one run directory), the spec
    as its config, iterations as the history's steps, events in the summary under
    ``raytron.event.<ms>.<kind>``; ended with exit code 0 when the job SUCCEEDED, else 1."""

    name = "wandb"

    def __init__(self, settings: dict, job_id: str, job_name: str, config: dict):
        self.project, self.mode = settings["project"], settings["mode"]
        self.entity, self.dir = settings.get("entity"), settings.get("dir")
        self.job_id, self.job_name, self.config = job_id, job_name, config
        self.run = None
        self.last_step = 0

    @property
    def where(self) -> str:
        return f"W&B project {self.project} ({self.mode})"

    def open(self) -> dict | None:
        if self.run is not None:
            return None
        import wandb

        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
        # Neither the runner's console nor the machine's stats nor git: the job's events are the record.
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False, init_timeout=30)
        run = wandb.init(project=self.project, entity=self.entity, dir=self.dir, mode=self.mode,
                         id=wandb_run_id(self.job_id), name=self.job_name, resume="allow", config=self.config,
                         tags=["raytron"], settings=settings)
        self.last_step = max(0, int(getattr(run, "starting_step", 0) or 0) - 1)
        self.run = run
        url = run.get_url() if self.mode == "online" else None
        return {"tracker": self.name, "run_id": run.id, "url": url, "resumed": bool(run.resumed),
                "dir": getattr(run.settings, "sync_dir", None)}

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last_step:
            return
        self.run.log(values, step=step)
        self.last_step = step

    def note(self, key: str, text: str) -> None:
        self.run.summary[key] = text[:5000]

    def end(self, state: str) -> None:
        self.run.finish(exit_code=0 if state == JobState.SUCCEEDED.value else 1)
