"""The REST API (``/api/v1``, described at ``/docs``), built by :func:`create_app`; nothing happens at import.

``create_app(settings, store=..., runners=..., cluster=...)`` wires the routes to one job store,
one runner back end and one cluster view. The app's lifespan starts the :class:`~service.server.scheduler.Scheduler`
(which first re-attaches to the jobs of an earlier server) and stops it on shutdown; running jobs
keep running.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI

from api.rest import errors, openapi
from api.rest.deps import require_job_access, require_token
from api.rest.limits import RateLimiter
from api.rest.errors import error_response
from api.rest.job_cache import JobCache
from api.rest.routes import checkpoints, cluster as cluster_routes, console, health, jobs, plan, streams, users
from service.server.accounts import Accounts, load_or_create_secret
from service.server.runners import JobRunners
from service.server.scheduler import ClusterView, Scheduler
from service.server.store import JobStore

API_PREFIX = "/api/v1"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the server is configured with (``raytron serve``'s flags)."""

    data_dir: Path
    """Job logs, the token file and (by default) the SQLite database live here."""
    api_token: str = field(repr=False)
    """The bootstrap admin's bearer token (other users' are in the store); never logged (``repr=False``)."""
    max_body_bytes: int = 1 << 20
    """Larger request bodies are refused with 413 before they are read."""
    submits_per_minute: float = 60.0
    """A user's submissions per minute past ``submit_burst`` (429 with Retry-After beyond; admins exempt)."""
    submit_burst: int = 20
    """Submissions a user may make at once before the per-minute rate applies."""
    max_queued_per_user: int = 100
    """A user's QUEUED jobs at most (429 beyond; admins exempt)."""
    max_user_priority: int = 0
    """The highest priority a user without its own ``max_priority`` may give a job (admins: no cap)."""
    default_tracking: dict | None = None
    """The ``tracking`` section a spec without one gets (``raytron serve --tracking-*``); a spec's own
    section wins, ``tracking: {}`` opts out."""
    poll_s: float = 0.5
    """How often the scheduler looks at runners and the queue."""
    max_stream_s: float | None = None
    """A followed event or log stream ends after this long (clients reconnect: Last-Event-ID, offset);
    None: it lasts until the job ends. Bounded for proxies that cut long responses, and for fuzzers."""


class BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes, by Content-Length or as it streams in."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers") or () if k == b"content-length"), None)

        def too_big():  # built when needed: most requests (every GET) carry no body
            return error_response(413, "body_too_large", f"the request body is larger than {self.limit} bytes")

        if length is not None and (not length.isdigit() or int(length) > self.limit):
            if not length.isdigit():
                return await error_response(400, "bad_request", "invalid Content-Length")(scope, receive, send)
            return await too_big()(scope, receive, send)
        if length is None and scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooBig()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooBig:
            await too_big()(scope, receive, send)


class _TooBig(Exception):
    pass


def create_app(settings: Settings, *, store: JobStore, runners: JobRunners, cluster: ClusterView,
               scheduler: Scheduler | None = None) -> FastAPI:
    """The FastAPI app.

    Args:
        settings: the server's settings.
        store: the job store (the single record).
        runners: starts job runners (:class:`service.server.runners.LocalProcessRunners`, ...).
        cluster: the nodes and GPU slots jobs are admitted against.
        scheduler: a ready scheduler (tests); default one over ``store``, ``runners`` and ``cluster``.
    """
    accounts = Accounts(store, load_or_create_secret(settings.data_dir), settings.api_token)
    scheduler = scheduler or Scheduler(store, runners, cluster, poll_s=settings.poll_s)
    scheduler.quota_of = accounts.gpu_quota

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="raytron", version="0.1.0", lifespan=lifespan,
                  description="Megatron-style 5D-parallel training jobs on Ray. Every route but /healthz needs "
                              "`Authorization: Bearer <token>`: a user's (`POST /api/v1/users`), or the bootstrap "
                              "admin's. A user sees and acts on its own jobs only (another's is a 404); an admin "
                              "on every job.")
    app.state.settings, app.state.store, app.state.scheduler, app.state.cluster = settings, store, scheduler, cluster
    app.state.runners, app.state.accounts = runners, accounts
    app.state.submit_limiter = RateLimiter(settings.submits_per_minute, settings.submit_burst)
    app.state.jobs = JobCache(store, lambda row: jobs.job_views(store, row))
    errors.install(app)
    openapi.install(app)
    api = [jobs.router, jobs.states_router, checkpoints.router, streams.router, plan.router, cluster_routes.router,
           users.router, users.admin_router]
    for router in api:
        # require_job_access: every route with a {job_id}, present and future, answers 404 for another's job
        app.include_router(router, prefix=API_PREFIX, dependencies=[Depends(require_token),
                                                                     Depends(require_job_access)])
    app.include_router(health.router)
    console.install(app)  # the web console: / and /static/* (no token), /console/yaml
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app

