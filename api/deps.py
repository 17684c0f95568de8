"""Dependencies of the routes: the app's store, scheduler, cluster and settings, and the token check.

Everything lives on ``app.state`` (set by :func:`api.app.create_app`); nothing is module-level,
so a test builds as many apps as it likes. They are ``async def`` though they never wait: FastAPI
runs a plain ``def`` dependency in its thread pool, a hop that cost more than the whole of a
cached ``GET /jobs/{id}`` (bench/api_bench.py).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.auth import token_matches
from api.job_cache import JobCache
from api.http_errors import ApiError
from service.server.scheduler import ClusterView, Scheduler
from service.server.store import JobStore

_bearer = HTTPBearer(auto_error=False, description="the token of RAYTRON_API_TOKEN or DATA_DIR/api_token")


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


async def require_token(request: Request,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None) -> None:
    """401 unless the request carries ``Authorization: Bearer <the token>``."""
    given = f"Bearer {credentials.credentials}" if credentials is not None else request.headers.get("authorization")
    if not token_matches(given, request.app.state.settings.api_token):
        raise ApiError(401, "unauthorized", "missing or wrong API token: send 'Authorization: Bearer <token>' "
                       "(RAYTRON_API_TOKEN, or the api_token file in the server's data dir)")


StoreDep = Annotated[JobStore, Depends(get_store)]
JobCacheDep = Annotated[JobCache, Depends(get_job_cache)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
ClusterDep = Annotated[ClusterView, Depends(get_cluster)]
SettingsDep = Annotated[object, Depends(get_settings)]
Authorized = Depends(require_token)
