"""Response models of the REST API (contract 4): what clients may rely on, shown at /docs.

The request side is the job spec (:class:`service.spec.spec.JobSpec`, plus ``priority``), checked by
:func:`service.spec.check.check_spec` so that a 422 lists one entry per problem.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class Problem(BaseModel):
    field: str = Field(description="the spec field, e.g. parallel.tensor_model_parallel_size")
    message: str = Field(description="what is wrong, with the numbers and the fix")


class ErrorBody(BaseModel):
    code: str = Field(description="stable error code, e.g. invalid_spec, job_not_found, unauthorized")
    message: str
    errors: list[Problem] | None = None


class Attempt(BaseModel):
    number: int
    started_at: float
    ended_at: float | None = None
    reason: str | None = None
    from_checkpoint: str | None = None


class JobSummary(BaseModel):
    id: str
    name: str
    state: str
    priority: int
    submitted_at: float
    updated_at: float
    iteration: int
    train_iters: int
    world_size: int
    ray_job_id: str | None = None
    error: dict | None = None


class JobPublic(JobSummary):
    losses: list[float] = Field(description="the LM loss of every iteration so far")
    tokens_per_s: float | None = Field(None, description="of the latest iteration")
    restarts: int
    attempts: list[Attempt]
    sizes: dict[str, int] | None = None
    spec: dict[str, Any]


class JobList(BaseModel):
    jobs: list[JobSummary]
    count: int


class EventPublic(BaseModel):
    seq: int
    time: float
    kind: str = Field(description="state | placement | iteration | failure | admission")
    state: str
    message: str
    data: dict | None = None


class EventList(BaseModel):
    job_id: str
    events: list[EventPublic]


class RankPlacement(BaseModel, extra="allow"):
    rank: int
    node_id: str | None = Field(None, description="the Ray node the rank ran on (null for local processes)")
    hostname: str | None = Field(None, description="the machine the rank ran on")
    node: str | int | None = Field(None, description="the cluster node admitted for the rank's bundle")
    local: int | None = Field(None, description="the rank's slot (GPU index) on its node")
    pid: int | None = None
    tp: int | None = None
    cp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None


class PlacementPublic(BaseModel):
    job_id: str
    attempt: int = Field(description="the attempt these ranks belong to (1-based; 0 before any started)")
    reported_at: float | None = None
    ranks: list[RankPlacement]


class NodePublic(BaseModel):
    node_id: str
    gpus: int
    gpus_used: int
    gpus_free: int
    alive: bool


class ClusterPublic(BaseModel):
    ray_address: str | None
    dashboard_url: str | None
    nodes: list[NodePublic]
    gpus_total: int
    gpus_free: int
    queue_length: int


class Health(BaseModel):
    status: str
