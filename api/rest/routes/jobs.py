"""``/api/v1/jobs``: submit, list, read, curves, place, cancel; ``/api/v1/job-states``: the states a job goes through.

Reading a job costs the same at iteration 10 and at iteration 10^6: the job row carries its latest
iteration's figures (the store writes them with each event), its view is built once per change
and served from memory (:mod:`api.rest.job_cache`), and the curves are read apart, a page or a
downsampled plot at a time (``GET /jobs/{id}/metrics``, :mod:`api.rest.curves`).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.rest import curves
from api.rest.deps import AccountsDep, JobCacheDep, SchedulerDep, SettingsDep, StoreDep, UserDep
from api.rest.errors import ApiError, status_of
from api.rest.limits import check_rate, check_submission
from api.rest.placement_view import placement_view
from api.rest.schemas import ErrorBody, JobList, JobPublic, JobStates, MetricsPage, PlacementPublic
from service.control.record import count_restarts
from service.control.events import JobEvent, JobState
from service.server.cluster_view import reported_gpu_type
from service.server.store import STATES, TERMINAL_STATES, JobStore, UnknownJob
from service.spec.check import check_spec, with_gpu_type
from service.spec.stored import stored_section

router = APIRouter(prefix="/jobs", tags=["jobs"])
states_router = APIRouter(tags=["jobs"])

SPEC_BODY = {"x-raytron-spec": True, "requestBody": {"required": True, "content": {"application/json": {
    # api/rest/openapi.py puts JobSpec's schema here (service/spec/spec.py; examples/*.yaml are specs)
    "schema": {"type": "object"},
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
    # The server's trackers (raytron serve --tracking-*) for a spec without a tracking section.
    default_tracking = request.app.state.settings.default_tracking
    if default_tracking and isinstance(data, dict) and "tracking" not in data:
        data = {**data, "tracking": default_tracking}
    # The accelerator the cluster's GPU nodes report through Ray, for a spec that names none.
    data = with_gpu_type(data, await run_in_threadpool(reported_gpu_type, request.app.state.cluster))
    # In a worker thread: a spec with `auto` fields is resolved by a layout search (seconds), which
    # must not stall the event loop every other request is served on.
    check = await run_in_threadpool(check_spec, data)
    if check.problems:
        n = len(check.problems)
        raise ApiError(422, "invalid_spec", f"the job spec has {n} problem{'s' if n > 1 else ''}: " +
                       "; ".join(f"{p['field']}: {p['message']}" for p in check.problems), errors=check.problems)
    return check


def job_summary(store: JobStore, row: dict) -> dict[str, Any]:
    """A job as the list shows it (:class:`~api.rest.schemas.JobSummary`): everything the console's jobs
    page draws, from the row and its state events (no metrics row is read)."""
    res = stored_section(row["spec"], "resources")
    return {**{k: row[k] for k in ("id", "name", "owner", "state", "priority", "submitted_at", "updated_at",
                                   "iteration", "ray_job_id", "error", "sizes")},
            "train_iters": stored_section(row["spec"], "training").train_iters,
            "world_size": res.num_nodes * res.gpus_per_node,
            "loss": curves.value(row["loss"]), "tokens_per_s": curves.value(row["tokens_per_s"]),
            "restarts": job_restarts(store, row["id"])}


def job_views(store: JobStore, row: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job's summary and its public view (:class:`~api.rest.schemas.JobPublic`): a few rows whatever its length."""
    summary = job_summary(store, row)
    return summary, {**summary, "attempts": store.attempts(row["id"]), "metric_names": row["metric_names"] or [],
                     "last_seq": row["last_seq"], "spec": row["spec"]}


def job_public(store: JobStore, row: dict) -> dict[str, Any]:
    return job_views(store, row)[1]


def job_restarts(store: JobStore, job_id: str) -> int:
    """The job's restarts by the controller's rule (:func:`service.control.record.is_restart`:
    a resize starts an attempt but is no restart), counted in its recorded state events."""
    return count_restarts(JobEvent.from_dict(e) for e in store.events(job_id, kind="state"))


def get_row(store: JobStore, job_id: str) -> dict:
    row = store.get_job(job_id)
    if row is None:
        raise UnknownJob(f"no job {job_id!r}")
    return row


@router.post("", status_code=201, response_model=JobPublic, openapi_extra=SPEC_BODY,
             responses={**_ERRORS, 400: {"model": ErrorBody}, 409: {"model": ErrorBody}, 422: {"model": ErrorBody},
                        429: {"model": ErrorBody}})
async def submit_job(request: Request, scheduler: SchedulerDep, store: StoreDep, user: UserDep,
                     accounts: AccountsDep, settings: SettingsDep) -> dict:
    """Store a job QUEUED, owned by the caller; it starts when the cluster can hold all of its ranks at
    once and the caller's GPU quota allows. 422 for an invalid spec, a job larger than the caller's
    quota or a priority above its cap; 429 (``Retry-After``) past the rate limit or the queued-jobs cap."""
    from service.spec.placement import plan_placement
    from service.spec.spec import grid_of

    try:
        check_rate(request.app.state.submit_limiter, user)
        check = await read_spec(request)
        spec = check.spec
        try:
            grid = grid_of(spec)
            plan_placement(grid, spec.resources.gpus_per_node, spec.resources.num_nodes)
        except ValueError as e:
            raise ApiError(422, "invalid_spec", str(e), errors=[{"field": "resources", "message": str(e)}]) from None
        await run_in_threadpool(check_submission, user, accounts, settings, priority=spec.priority,
                                num_gpus=spec.resources.num_nodes * spec.resources.gpus_per_node)
        row = await run_in_threadpool(scheduler.submit, spec, sizes=grid.sizes(),
                                      owner=user.name)
    except Exception as e:
        await run_in_threadpool(accounts.record, user.name, "submit", None, status_of(e),
                                code=getattr(e, "code", type(e).__name__), message=str(e)[:500])
        raise
    await run_in_threadpool(_record_auto_layout, store, row["id"], json.loads(await request.body()))
    await run_in_threadpool(accounts.record, user.name, "submit", row["id"], 201, priority=spec.priority,
                            gpus=spec.resources.num_nodes * spec.resources.gpus_per_node)
    return await run_in_threadpool(job_public, store, row)


def _record_auto_layout(store: JobStore, job_id: str, data) -> None:
    """An auto spec's choice as the job's ``layout`` event (service.control.trials.layout_record)."""
    from service.control.trials import auto_layout_record, layout_message

    record = auto_layout_record(data)
    if record is not None:
        store.append_event(job_id, JobEvent.now("layout", JobState.QUEUED, layout_message(record), record).to_dict())


@router.get("", response_model=JobList, responses=_ERRORS)
def list_jobs(cache: JobCacheDep, store: StoreDep, user: UserDep, limit: int = Query(100, ge=1, le=1000),
              cursor: str | None = Query(None, pattern=r"^[0-9]{1,18}$",
                                         description="the next_cursor of the previous page"),
              state: JobState | None = Query(None, description="only jobs in this state"),
              name: str | None = Query(None, max_length=256, description="only jobs of this name"),
              owner: str | None = Query(None, max_length=128, description="only jobs of this user (admins; a user "
                                        "sees only their own jobs whatever this says)")) -> JSONResponse:
    """The caller's jobs (an admin's: everyone's), newest first, a page at a time (``next_cursor`` leads
    to the next one)."""
    rows = store.list_jobs(limit=limit + 1, states=(state.value,) if state else None, name=name,
                           before=int(cursor) if cursor is not None else None,
                           owner=owner if user.admin else user.name)
    page = rows[:limit]
    more = len(rows) > limit
    return JSONResponse({"jobs": [cache.from_row(r).summary for r in page], "count": len(page),
                         "next_cursor": str(page[-1]["number"]) if more else None})


@router.get("/{job_id}", response_model=JobPublic, responses=_ERRORS)
async def get_job(job_id: str, cache: JobCacheDep) -> Response:
    """State, iteration, latest loss and tokens/s, restarts, attempts, sizes, ray_job_id, error and spec
    of one job: the same size at any length of the run (its curves: ``GET /jobs/{id}/metrics``)."""
    # a hit costs microseconds and stays on the event loop; a miss reads the store in a thread
    view = cache.fresh(job_id) or await run_in_threadpool(cache.current, job_id)
    if view is None:
        raise UnknownJob(f"no job {job_id!r}")
    return Response(view.body, media_type="application/json")


_NAMES = Query(None, max_length=1000, pattern=r"^[A-Za-z0-9_.,-]*$",
               description="comma-separated metric names (default: every one the job reports, its metric_names)")


@router.get("/{job_id}/metrics", response_model=MetricsPage, responses=_ERRORS)
def get_metrics(job_id: str, cache: JobCacheDep, store: StoreDep, names: str | None = _NAMES,
                after: int = Query(0, ge=0, le=2**31 - 1, description="only iterations after this one"),
                limit: int = Query(1000, ge=1, le=10000, description="at most this many iterations (a page)"),
                points: int | None = Query(None, ge=2, le=10000, description="downsampled for a plot: at most this "
                                           "many of the iterations after `after`, the first, the last and each "
                                           "restart's or resize's first kept (replaces paging)")) -> Response:
    """A job's per-iteration metrics: a page of ``limit`` iterations after ``after`` (follow ``next_after``
    to walk the whole curve once), or, with ``points``, the whole curve downsampled (min/max buckets)."""
    view = cache.current(job_id)
    if view is None:
        raise UnknownJob(f"no job {job_id!r}")
    wanted = [n for n in (names.split(",") if names is not None else view.public["metric_names"]) if n]
    wanted = list(dict.fromkeys(wanted))
    if reserved := [n for n in wanted if n in curves.RESERVED]:
        raise ApiError(422, "invalid_request", f"{', '.join(reserved)} is not a metric name; the metrics are "
                       f"{', '.join(view.public['metric_names']) or '(none reported yet)'}")
    if points is not None:  # reads the whole curve: once per version of the job (a finished one: once)
        def plot() -> bytes:
            rows = store.metric_rows(job_id, after_iteration=after)
            main = "loss" if "loss" in wanted else (wanted[0] if wanted else "loss")
            chosen = curves.downsample([curves.value(r[2].get(main)) for r in rows], [r[1] for r in rows], points)
            return json.dumps({"job_id": job_id, **curves.columns([rows[i] for i in chosen], wanted),
                               "next_after": None}, separators=(",", ":")).encode()
        return Response(view.remember(("points", tuple(wanted), after, points), plot), media_type="application/json")
    rows = store.metric_rows(job_id, after_iteration=after, limit=limit + 1)
    next_after = rows[limit - 1][0] if len(rows) > limit else None
    rows = rows[:limit]
    return JSONResponse({"job_id": job_id, **curves.columns(rows, wanted), "next_after": next_after})


@router.get("/{job_id}/placement", response_model=PlacementPublic, responses=_ERRORS)
def get_placement(job_id: str, store: StoreDep) -> dict:
    """Where each rank runs, as the ranks reported it in the job's latest placed attempt: the whole
    view the console draws (:func:`api.rest.placement_view.placement_view`: each rank's node, slot and
    coordinates, the plan filling in what a record lacks)."""
    row = get_row(store, job_id)
    events = store.events(job_id, kind="placement")
    attempts = store.attempts(job_id)
    gpus_per_node = stored_section(row["spec"], "resources").gpus_per_node
    if not events:
        return {"job_id": job_id, "attempt": len(attempts), "reported_at": None, "gpus_per_node": gpus_per_node,
                "ranks": []}
    last = events[-1]
    admitted = store.events(job_id, kind="admission")
    nodes = (admitted[-1]["data"] or {}).get("nodes", []) if admitted else []
    ranks = placement_view((last["data"] or {}).get("placement") or [], lambda: _planned(store, row, last["time"]),
                           nodes)
    return {"job_id": job_id, "attempt": sum(1 for a in attempts if a["started_at"] <= last["time"]),
            "reported_at": last["time"], "gpus_per_node": gpus_per_node, "ranks": ranks,
            "spares": (last["data"] or {}).get("spares") or []}


def _planned(store: JobStore, row: dict, before: float) -> list[dict]:
    """The placement plan of the job's attempt placed at ``before``, at the size it started with
    (its STARTING event's ``num_nodes``: a resized attempt runs on fewer or more nodes than the spec's)."""
    from service.spec.plan import plan_job
    from service.spec.spec import parse_spec

    try:
        spec = parse_spec(row["spec"])
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
def cancel_job(job_id: str, scheduler: SchedulerDep, cache: JobCacheDep, user: UserDep,
               accounts: AccountsDep) -> Response:
    """Cancel a job: a queued one at once; a running one is stopped (its ranks too) in the background."""
    try:
        scheduler.cancel(job_id)
    except Exception as e:
        accounts.record(user.name, "cancel", job_id, status_of(e), message=str(e)[:500])
        raise
    accounts.record(user.name, "cancel", job_id, 202)
    return Response(cache.current(job_id).body, media_type="application/json", status_code=202)
