"""The job spec's ``tracking`` section: the experiment tracker a job's curves go to (MLflow;
:mod:`service.control.tracking` logs them)."""

from __future__ import annotations

import importlib.util

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


class TrackingSpec(BaseModel):
    """One tracker run per job (resumed across restarts, resizes and server restarts): the
    metrics TensorBoard gets, the spec as parameters, the job's events as tags. A tracker that
    cannot be reached does not fail the job; its events say so."""

    model_config = STRICT
    mlflow: MLflowSpec | None = Field(None, description="log to MLflow")
