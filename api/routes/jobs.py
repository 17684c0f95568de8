"""``/api/v1/jobs``: submit, list, read, place, cancel."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Query, Request

from api.deps import SchedulerDep, StoreDep
from api.http_errors import ApiError
from api.schemas import ErrorBody, JobList, JobPublic, JobSummary, PlacementPublic
from service.spec.check import check_spec
from service.server.store import STATES, JobStore, UnknownJob

router = APIRouter(prefix="/jobs", tags=["jobs"])

SPEC_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "description": "a job spec (ARCHITECTURE.md contract 1) plus an optional "
               "integer priority; unknown fields are refused"},
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


def job_summary(row: dict) -> dict[str, Any]:
    spec = row["spec"] or {}
    res, training = spec.get("resources") or {}, spec.get("training") or {}
    return {**{k: row[k] for k in ("id", "name", "state", "priority", "submitted_at", "updated_at", "iteration",
                                   "ray_job_id", "error")},
            "train_iters": training.get("train_iters", 0),
            "world_size": res.get("num_nodes", 1) * res.get("gpus_per_node", 1)}


def job_public(store: JobStore, row: dict) -> dict[str, Any]:
    metrics = store.metrics(row["id"])
    attempts = store.attempts(row["id"])
    return {**job_summary(row), "losses": [m["loss"] for m in metrics if "loss" in m],
            "tokens_per_s": metrics[-1].get("tokens_per_s") if metrics else None,
            "restarts": max(0, len(attempts) - 1), "attempts": attempts, "sizes": row["sizes"], "spec": row["spec"]}


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
    return {"jobs": [JobSummary(**job_summary(r)) for r in rows], "count": len(rows)}


@router.get("/{job_id}", response_model=JobPublic, responses=_ERRORS)
def get_job(job_id: str, store: StoreDep) -> dict:
    """State, iteration, losses, restarts, attempts, sizes, ray_job_id and error of one job."""
    return job_public(store, get_row(store, job_id))


@router.get("/{job_id}/placement", response_model=PlacementPublic, responses=_ERRORS)
def get_placement(job_id: str, store: StoreDep) -> dict:
    """Where each rank runs, as the ranks reported it in the job's latest attempt."""
    get_row(store, job_id)
    events = store.events(job_id, kind="placement")
    attempts = store.attempts(job_id)
    if not events:
        return {"job_id": job_id, "attempt": len(attempts), "reported_at": None, "ranks": []}
    last = events[-1]
    ranks = sorted((last["data"] or {}).get("placement") or [], key=lambda r: r.get("rank", 0))
    return {"job_id": job_id, "attempt": len(attempts), "reported_at": last["time"],
            "ranks": _with_slots(store, job_id, ranks)}


def _with_slots(store: JobStore, job_id: str, ranks: list[dict]) -> list[dict]:
    """Fill in the planned node (the admitted node's id) and local slot of ranks that did not report one."""
    if not ranks or all("local" in r for r in ranks):
        return ranks
    from service.spec.placement import plan_placement
    from service.spec.spec import grid_of, parse_spec

    row = get_row(store, job_id)
    try:
        spec = parse_spec({k: v for k, v in row["spec"].items() if k != "priority"})
        grid = grid_of(spec)
        plan = plan_placement(grid, spec.resources.gpus_per_node, spec.resources.num_nodes)
    except ValueError:
        return ranks
    admitted = store.events(job_id, kind="admission")
    nodes = (admitted[-1]["data"] or {}).get("nodes", []) if admitted else []
    out = []
    for r in ranks:
        planned = plan[r["rank"]] if 0 <= r.get("rank", -1) < len(plan) else None
        if planned is not None:
            r = {"node": nodes[planned.node] if planned.node < len(nodes) else planned.node,
                 "local": planned.local, **r}
        out.append(r)
    return out


@router.post("/{job_id}/cancel", status_code=202, response_model=JobPublic,
             responses={**_ERRORS, 409: {"model": ErrorBody}})
def cancel_job(job_id: str, scheduler: SchedulerDep, store: StoreDep) -> dict:
    """Cancel a job: a queued one at once; a running one is stopped (its ranks too) in the background."""
    scheduler.cancel(job_id)
    return job_public(store, get_row(store, job_id))
