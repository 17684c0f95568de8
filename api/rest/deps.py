"""Dependencies of the routes: the app's store, scheduler, cluster and settings, and the token check.

Everything lives on ``app.state`` (set by :func:`api.rest.app.create_app`); nothing is module-level,
so a test builds as many apps as it likes. They are ``async def`` though they never wait: FastAPI
runs a plain ``def`` dependency in its thread pool, a hop that cost more than the whole of a
cached ``GET /jobs/{id}`` (bench/api_bench.py).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from starlette.concurrency import run_in_threadpool

from api.rest.auth import bearer_token
from api.rest.job_cache import JobCache
from api.rest.errors import ApiError
from service.server.accounts import Accounts, User
from service.server.scheduler import ClusterView, Scheduler
from service.server.store import JobStore, UnknownJob

_bearer = HTTPBearer(auto_error=False, description="a user's token (`raytron users add`), or the bootstrap admin's: "
                     "RAYTRON_API_TOKEN or DATA_DIR/api_token")


async def get_store(request: Request) -> JobStore:
    return request.app.state.store


async def get_job_cache(request: Request) -> JobCache:
    return request.app.state.jobs


async def get_scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def get_cluster(request: Request) -> ClusterView:
    return request.app.state.cluster


async def get_settings(request: Request):
    return request.app.state.settings


async def get_accounts(request: Request) -> Accounts:
    return request.app.state.accounts


async def require_token(request: Request,
                        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None) -> User:
    """The caller: 401 unless the request carries ``Authorization: Bearer <a live token>`` (recorded
    in the audit trail, without the token)."""
    given = credentials.credentials if credentials is not None else bearer_token(request.headers.get("authorization"))
    accounts: Accounts = request.app.state.accounts
    user = accounts.cached(given)  # the bootstrap admin's token, or one seen before: no database read
    if user is None and given:
        user = await run_in_threadpool(accounts.authenticate, given)
    if user is None:
        await run_in_threadpool(accounts.record, None, "auth", f"{request.method} {request.url.path}", 401,
                                reason="wrong or revoked token" if given else "no token")
        raise ApiError(401, "unauthorized", "missing, wrong or revoked API token: send 'Authorization: Bearer "
                       "<token>' (yours from `raytron users add/token`, or the bootstrap admin's: RAYTRON_API_TOKEN "
                       "or the api_token file in the server's data dir)")
    request.state.user = user
    return user


async def require_job_access(request: Request, user: Annotated[User, Depends(require_token)]) -> None:
    """On every route with a ``{job_id}``: another user's job is a 404, the same as no job at all (never
    a 403 that confirms it exists); an admin reaches every job. A refused write is audited."""
    job_id = request.path_params.get("job_id")
    if job_id is None or user.admin:
        return
    accounts: Accounts = request.app.state.accounts
    if await run_in_threadpool(accounts.owner_of, job_id) != user.name:
        if request.method not in ("GET", "HEAD"):
            action = request.url.path.rstrip("/").rsplit("/", 1)[-1]
            await run_in_threadpool(accounts.record, user.name, action, job_id, 404, reason="not the caller's job")
        raise UnknownJob(f"no job {job_id!r}")


async def require_admin(user: Annotated[User, Depends(require_token)]) -> User:
    """403 unless the caller is an admin."""
    if not user.admin:
        raise ApiError(403, "forbidden", f"user {user.name!r} is not an admin; this needs an admin's token")
    return user


StoreDep = Annotated[JobStore, Depends(get_store)]
JobCacheDep = Annotated[JobCache, Depends(get_job_cache)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
ClusterDep = Annotated[ClusterView, Depends(get_cluster)]
SettingsDep = Annotated[object, Depends(get_settings)]
AccountsDep = Annotated[Accounts, Depends(get_accounts)]
UserDep = Annotated[User, Depends(require_token)]
Authorized = Depends(require_token)
