"""The job spec's ``tracking`` section: the experiment trackers a job's curves go to (MLflow, Weights &
Biases; :mod:`service.control.tracking` logs them)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from service.spec.sections import STRICT


class MLflowSpec(BaseModel):
    model_config = STRICT
    tracking_uri: str = Field(min_length=1, description="the MLflow tracking server, e.g. http://mlflow:5000 "
                              "(a path or sqlite:/// URI also works)")
    experiment: str = Field("raytron", min_length=1, description="the experiment the job's run goes in "
                            "(created when missing)")

    @model_validator(mode="after")
    def _installed(self):
        if importlib.util.find_spec("mlflow") is None:
            raise ValueError("tracking.mlflow needs the mlflow package, which is not installed: pip install "
                             "'raytron[tracking]' (or mlflow), or drop tracking.mlflow")
        return self


class WandbSpec(BaseModel):
    model_config = STRICT
    project: str = Field(min_length=1, max_length=128, description="the W&B project the job's run goes in")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="online (needs WANDB_API_KEY, or a `wandb login`, where the job's runner runs), "
        "offline (a run directory under `dir`, for `wandb sync`), or disabled")
    entity: str | None = Field(None, min_length=1, description="the W&B team or user (default: the API key's)")
    dir: str | None = Field(None, min_length=1, description="where the run's files go (a `wandb` directory in it; "
                            "default $WANDB_DIR, else the runner's working directory)")

    @model_validator(mode="after")
    def _installed(self):
        if self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise ValueError("tracking.wandb needs the wandb package, which is not installed: pip install "
                             "'raytron[tracking]' (or wandb), or drop tracking.wandb")
        return self


class TrackingSpec(BaseModel):
    """One tracker run per job (resumed across restarts, resizes and server restarts): the
    metrics TensorBoard gets, the spec as parameters, the job's events as notes. A tracker that
    cannot be reached does not fail the job; its events say so."""

    model_config = STRICT
    mlflow: MLflowSpec | None = Field(None, description="log to MLflow")
    wandb: WandbSpec | None = Field(None, description="log to Weights & Biases")
