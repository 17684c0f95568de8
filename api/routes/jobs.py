"""``/api/v1/jobs``: submit, list, read, place, cancel; ``/api/v1/job-states``: the states a job goes through."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Query, Request

from api.deps import SchedulerDep, StoreDep
from api.http_errors import ApiError
from api.placement_view import placement_view
from api.schemas import ErrorBody, JobList, JobPublic, JobStates, JobSummary, PlacementPublic
from service.control.controller import count_restarts
from service.control.events import JobEvent
from service.spec.check import check_spec
from service.server.store import STATES, TERMINAL_STATES, JobStore, UnknownJob

router = APIRouter(prefix="/jobs", tags=["jobs"])
states_router = APIRouter(tags=["jobs"])

SPEC_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "description": "a job spec (JobSpec in service/spec/spec.py; examples/*.yaml "
               "are specs) plus an optional integer priority; unknown fields are refused"},
    "example": {"name": "tiny", "priority": 0, "model": {"num_layers": 2, "hidden_size": 32,
                "num_attention_heads": 4}, "training": {"train_iters": 5, "global_batch_size": 4,
                "micro_batch_size": 1}, "resources": {"num_nodes": 1, "gpus_per_node": 1}}}}}}
_ERRORS = {401: {"model": ErrorBody}, 404: {"model": ErrorBody}}


async def read_spec(request: Request):
    """The body as a checked spec: 400 for bad JSON, 422 (one entry per problem) for an invalid spec."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"the request body is not valid JSON: {e}") from None
    check = check_spec(data)
    if check.problems:
        n = len(check.problems)
        raise ApiError(422, "invalid_spec", f"the job spec has {n} problem{'s' if n > 1 else ''}: " +
                       "; ".join(f"{p['field']}: {p['message']}" for p in check.problems), errors=check.problems)
    return check


def job_summary(store: JobStore, row: dict, metrics: list[dict] | None = None) -> dict[str, Any]:
    """A job as the list shows it (:class:`~api.schemas.JobSummary`): everything the console's jobs
    page draws. ``metrics``: the job's, when the caller has read them already."""
    spec = row["spec"] or {}
    res, training = spec.get("resources") or {}, spec.get("training") or {}
    latest = latest_metrics(store, row, metrics)
    return {**{k: row[k] for k in ("id", "name", "state", "priority", "submitted_at", "updated_at", "iteration",
                                   "ray_job_id", "error", "sizes")},
            "train_iters": training.get("train_iters", 0),
            "world_size": res.get("num_nodes", 1) * res.get("gpus_per_node", 1),
            "loss": latest.get("loss") if latest else None, "restarts": job_restarts(store, row["id"])}


def job_public(store: JobStore, row: dict) -> dict[str, Any]:
    metrics = store.metrics(row["id"])
    return {**job_summary(store, row, metrics), "losses": [m["loss"] for m in metrics if "loss" in m],
            "tokens_per_s": metrics[-1].get("tokens_per_s") if metrics else None,
            "attempts": store.attempts(row["id"]), "spec": row["spec"]}


def job_restarts(store: JobStore, job_id: str) -> int:
    """The job's restarts by the controller's rule (:func:`service.control.controller.is_restart`:
    a resize starts an attempt but is no restart), counted in its recorded state events."""
    return count_restarts(JobEvent.from_dict(e) for e in store.events(job_id, kind="state"))


def latest_metrics(store: JobStore, row: dict, metrics: list[dict] | None = None) -> dict | None:
    """The metrics of the job's current iteration (after a restart from a checkpoint, those of the
    iteration run again, not the earlier attempt's further ones); None before the first.
    ``metrics``: the job's, when read already (else only that iteration's are read)."""
    if not row["iteration"]:
        return None
    if metrics is None:
        metrics = store.metrics(row["id"], after_iteration=row["iteration"] - 1)
    return next((m for m in metrics if m["iteration"] == row["iteration"]), None)


def get_row(store: JobStore, job_id: str) -> dict:
    row = store.get_job(job_id)
    if row is None:
        raise UnknownJob(f"no job {job_id!r}")
    return row


@router.post("", status_code=201, response_model=JobPublic, openapi_extra=SPEC_BODY,
             responses={**_ERRORS, 400: {"model": ErrorBody}, 409: {"model": ErrorBody}, 422: {"model": ErrorBody}})
async def submit_job(request: Request, scheduler: SchedulerDep, store: StoreDep) -> dict:
    """Store a job QUEUED; it starts when the cluster can hold all of its ranks at once."""
    from starlette.concurrency import run_in_threadpool

    from service.spec.placement import plan_placement
    from service.spec.spec import grid_of

    check = await read_spec(request)
    spec = check.spec
    try:
        grid = grid_of(spec)
        plan_placement(grid, spec.resources.gpus_per_node, spec.resources.num_nodes)
    except ValueError as e:
        raise ApiError(422, "invalid_spec", str(e), errors=[{"field": "resources", "message": str(e)}]) from None
    row = await run_in_threadpool(scheduler.submit, spec, priority=check.priority, sizes=grid.sizes())
    return await run_in_threadpool(job_public, store, row)


@router.get("", response_model=JobList, responses=_ERRORS)
def list_jobs(store: StoreDep, limit: int = Query(100, ge=1, le=1000),
              state: str | None = Query(None, description=f"only jobs in this state: {', '.join(STATES)}")) -> dict:
    """Jobs, newest first."""
    if state is not None and state not in STATES:
        raise ApiError(422, "invalid_request", f"unknown state {state!r}; one of {', '.join(STATES)}")
    rows = store.list_jobs(limit=limit, states=(state,) if state else None)
    return {"jobs": [JobSummary(**job_summary(store, r)) for r in rows], "count": len(rows)}


@router.get("/{job_id}", response_model=JobPublic, responses=_ERRORS)
def get_job(job_id: str, store: StoreDep) -> dict:
    """State, iteration, losses, restarts, attempts, sizes, ray_job_id and error of one job."""
    return job_public(store, get_row(store, job_id))


@router.get("/{job_id}/placement", response_model=PlacementPublic, responses=_ERRORS)
def get_placement(job_id: str, store: StoreDep) -> dict:
    """Where each rank runs, as the ranks reported it in the job's latest placed attempt: the whole
    view the console draws (:func:`api.placement_view.placement_view`: each rank's node, slot and
    coordinates, the plan filling in what a record lacks)."""
    row = get_row(store, job_id)
    events = store.events(job_id, kind="placement")
    attempts = store.attempts(job_id)
    gpus_per_node = ((row["spec"] or {}).get("resources") or {}).get("gpus_per_node")
    if not events:
        return {"job_id": job_id, "attempt": len(attempts), "reported_at": None, "gpus_per_node": gpus_per_node,
                "ranks": []}
    last = events[-1]
    admitted = store.events(job_id, kind="admission")
    nodes = (admitted[-1]["data"] or {}).get("nodes", []) if admitted else []
    ranks = placement_view((last["data"] or {}).get("placement") or [], lambda: _planned(store, row, last["time"]),
                           nodes)
    return {"job_id": job_id, "attempt": sum(1 for a in attempts if a["started_at"] <= last["time"]),
            "reported_at": last["time"], "gpus_per_node": gpus_per_node, "ranks": ranks}


def _planned(store: JobStore, row: dict, before: float) -> list[dict]:
    """The placement plan of the job's attempt placed at ``before``, at the size it started with
    (its STARTING event's ``num_nodes``: a resized attempt runs on fewer or more nodes than the spec's)."""
    from service.spec.plan import plan_job
    from service.spec.spec import parse_spec

    try:
        spec = parse_spec({k: v for k, v in row["spec"].items() if k != "priority"})
    except ValueError:
        return []
    starts = [e for e in store.events(row["id"], kind="state") if e["state"] == "STARTING" and e["time"] <= before]
    num_nodes = ((starts[-1]["data"] or {}).get("num_nodes") if starts else None) or spec.resources.num_nodes
    if num_nodes != spec.resources.num_nodes:
        spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"num_nodes": num_nodes})})
    try:
        return plan_job(spec)["placement"]
    except ValueError:
        return []


@states_router.get("/job-states", response_model=JobStates, responses=_ERRORS)
def job_states() -> dict:
    """The states a job goes through, in their order (``QUEUED``, ``STARTING``, ``RUNNING``,
    ``RESTARTING``, then one of the final ones), and the final (terminal) ones: a job in one of
    them never changes again and cannot be cancelled. The source is ``JobState`` in
    service/control/events.py; the web console reads this instead of keeping its own copy."""
    return {"states": list(STATES), "terminal": [s for s in STATES if s in TERMINAL_STATES]}


@router.post("/{job_id}/cancel", status_code=202, response_model=JobPublic,
             responses={**_ERRORS, 409: {"model": ErrorBody}})
def cancel_job(job_id: str, scheduler: SchedulerDep, store: StoreDep) -> dict:
    """Cancel a job: a queued one at once; a running one is stopped (its ranks too) in the background."""
    scheduler.cancel(job_id)
    return job_public(store, get_row(store, job_id))
