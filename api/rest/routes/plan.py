"""``POST /api/v1/plan``: grid, placement, memory and traffic of a spec; runs nothing."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from api.rest.errors import ApiError
from api.rest.routes.jobs import SPEC_BODY, read_spec
from api.rest.schemas import ErrorBody
from service.spec.plan import plan_job

router = APIRouter(tags=["plan"])


@router.post("/plan", openapi_extra=SPEC_BODY, responses={400: {"model": ErrorBody}, 422: {"model": ErrorBody}})
async def plan(request: Request) -> dict:
    """The rank grid, the placement plan, per-rank memory (with and without the distributed optimizer)
    and bytes per iteration of TP, CP, EP, DP and PP traffic, in-node vs cross-node."""
    check = await read_spec(request)
    try:
        return await run_in_threadpool(plan_job, check.spec)
    except ValueError as e:
        raise ApiError(422, "invalid_spec", str(e), errors=[{"field": "resources", "message": str(e)}]) from None
