"""Response models of the REST API (``/api/v1``): what clients may rely on, shown at /docs.

The request side is the job spec (:class:`service.spec.spec.JobSpec`, plus ``priority``), checked by
:func:`service.spec.check.check_spec` so that a 422 lists one entry per problem.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.spec.limits import MAX_PRIORITY


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
    """A job in the list: what the console's jobs page shows of it (the page needs nothing else)."""

    id: str
    name: str
    owner: str = Field(description="the user who submitted it")
    state: str
    priority: int
    submitted_at: float
    updated_at: float
    iteration: int = Field(description="the latest iteration")
    train_iters: int
    world_size: int
    sizes: dict[str, int] | None = Field(None, description="the parallel sizes it runs at now (tp, pp, dp, ...)")
    loss: float | None = Field(None, description="the LM loss of the latest iteration")
    tokens_per_s: float | None = Field(None, description="of the latest iteration")
    restarts: int = Field(description="restarts after a failure; a resize starts an attempt but is no restart")
    ray_job_id: str | None = None
    error: dict | None = None


class JobPublic(JobSummary):
    """One job. Its size does not grow with the run's length: the curves are at ``/jobs/{id}/metrics``."""

    attempts: list[Attempt] = Field(description="one per start: the first, each restart and each resize")
    metric_names: list[str] = Field(description="the per-iteration metrics the job reports (GET /jobs/{id}/metrics)")
    last_seq: int = Field(description="the seq of its latest event: follow the events after it to see only what is new")
    spec: dict[str, Any]


class JobList(BaseModel):
    jobs: list[JobSummary]
    count: int = Field(description="jobs on this page")
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next (older) page; null on the last")


class MetricsPage(BaseModel):
    """Per-iteration metrics as parallel lists: ``iterations[i]``'s ``loss`` is ``loss[i]``; one more
    list per requested name (a number, or null where that iteration did not report it)."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, list[float | None]] = Field(init=False)

    job_id: str
    iterations: list[int] = Field(description="ascending")
    attempt: list[int | None] = Field(description="the attempt that ran each iteration (a restart or resize begins "
                                      "where it changes); null for iterations stored before this was recorded")
    next_after: int | None = Field(description="pass as ?after= for the next page; null when this page reaches the end "
                                   "(always null with ?points=)")


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
    """One rank: its placement record as it reported it, completed from the plan (api/rest/placement_view.py)."""

    rank: int
    node: str | int | None = Field(None, description="the node the rank is drawn in: the launcher's node index "
                                   "(local processes), else node_id, else hostname, else the planned node")
    node_id: str | None = Field(None, description="the Ray node the rank reported (none for a local process)")
    hostname: str | None = Field(None, description="the machine the rank reported")
    local: int | None = Field(None, description="the rank's slot (GPU index) on its node")
    pid: int | None = None
    tp: int | None = None
    cp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = Field(None, description="expert tensor-parallel rank")
    expert_dp: int | None = Field(None, description="expert data-parallel rank")


class SparePublic(BaseModel):
    """A hot spare node of a job (resources.spare_nodes): idle rank actors that take a lost node's ranks."""

    job_id: str | None = None
    bundle: int = Field(description="the spare's bundle in the job's placement group")
    node_id: str | None = Field(None, description="the Ray node holding it (none while Ray places it)")
    actors: int = Field(description="spare rank actors started on it")
    ready: int = Field(description="of those, the ones up (torch and the trainer imported)")


class PlacementPublic(BaseModel):
    job_id: str
    attempt: int = Field(description="the attempt these ranks belong to (1-based; 0 before any started)")
    reported_at: float | None = None
    gpus_per_node: int | None = Field(None, description="GPU slots per node (the map draws the free ones too)")
    ranks: list[RankPlacement]
    spares: list[SparePublic] = Field([], description="the job's hot spares when its ranks were placed")


class CheckpointEntry(BaseModel):
    iteration: int
    location: str = Field(description="the checkpoint's directory or URI")
    format: str | None = None
    metrics: dict[str, float] = Field(description="what was saved with it: val_loss (an evaluation at its "
                                                  "iteration), lm_loss")
    size_bytes: int
    kept_because: str | None = Field(None, description="last, best val_loss 2.31, ...: the retention rule that "
                                                       "keeps it (None: the next commit prunes it)")


class CheckpointList(BaseModel):
    job_id: str
    root: str = Field(description="where the job saves (checkpoint.dir, or under the server's data dir)")
    keep_last: int
    keep_best: int
    best_metric: str
    checkpoints: list[CheckpointEntry] = Field(description="complete checkpoints, oldest first")


class JobStates(BaseModel):
    states: list[str] = Field(description="every job state, in the order a job goes through them")
    terminal: list[str] = Field(description="the final ones: a job in one never changes again")


class NodePublic(BaseModel):
    node_id: str
    gpus: int
    gpus_used: int
    gpus_free: int
    alive: bool
    accelerator: str | None = Field(None, description="the node's accelerator as Ray labels it (accelerator_type)")


class ClusterPublic(BaseModel):
    ray_address: str | None
    dashboard_url: str | None
    gpu_type: str | None = Field(None, description="the resources.gpu_type a spec that names no accelerator "
                                 "gets: the type every GPU node reports (none: the simulated CPU cluster's figures)")
    nodes: list[NodePublic]
    spares: list[SparePublic] = Field([], description="the hot spares of the active jobs, as last placed")
    gpus_total: int
    gpus_free: int
    queue_length: int


class Health(BaseModel):
    status: str


# ---- users, tokens and the audit trail (api/rest/routes/users.py) -------------------------------------

USER_NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"


class UserIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # JSON types as written: no false for 0

    name: str = Field(pattern=USER_NAME, description="lower-case letters, digits, _ . - (at most 64)")
    admin: bool = Field(False, description="may manage users, read the audit trail and see every job")
    gpu_quota: int | None = Field(None, ge=1, le=1 << 20, description="GPU slots the user's running jobs may hold "
                                  "together; a larger job is refused, one that would exceed it waits QUEUED; "
                                  "null: no quota")
    max_priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="the highest priority the user may give a "
                                     "job; null: the server's --max-user-priority (admins: no cap)")


class UserPublic(BaseModel):
    name: str
    admin: bool
    gpu_quota: int | None
    max_priority: int | None
    tokens: int = Field(description="live tokens (the bootstrap admin's own is not stored, not counted)")
    created_at: float


class UserList(BaseModel):
    users: list[UserPublic]


class Me(BaseModel):
    name: str
    admin: bool
    gpu_quota: int | None
    max_priority: int | None


class TokenIssued(BaseModel):
    """A new token: shown this once, stored only as a digest."""

    name: str
    token: str


class Revoked(BaseModel):
    name: str
    revoked: int = Field(description="how many live tokens were revoked")


class AuditEntry(BaseModel):
    id: int
    time: float
    user: str | None = Field(description="who (null: a request without a valid token)")
    action: str = Field(description="submit, cancel, auth, users.add, users.token, users.revoke, users.remove")
    target: str | None = Field(description="the job id, the user name, or the refused request's method and path")
    status: int = Field(description="the HTTP status it was answered with")
    detail: dict | None = None


class AuditPage(BaseModel):
    entries: list[AuditEntry]
    count: int
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next (older) page")
