"""JSON errors with stable codes: every failure of a request is ``{"code", "message", ...}``.

Handlers turn FastAPI's and the service's exceptions into those bodies, so no request ever
gets an HTML page or a traceback; a malformed request (bad JSON, wrong types, unknown ids) is
a 4xx. Codes are stable: clients may switch on them.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.server.accounts import UnknownUser, UserExists
from service.server.scheduler import JobNotActive, NeverFits
from service.server.store import UnknownJob

log = logging.getLogger("raytron.api")

_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 406: "not_acceptable", 409: "conflict", 413: "body_too_large",
               415: "unsupported_media_type", 422: "invalid_request", 429: "too_many_requests"}


_STATUS = {UnknownJob: 404, UnknownUser: 404, NeverFits: 409, JobNotActive: 409, UserExists: 409}


class ApiError(Exception):
    """An error answer: HTTP ``status``, stable ``code``, a readable ``message`` and extra fields."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.code, self.message, self.extra, self.headers = status, code, message, extra, headers


def status_of(exc: Exception) -> int:
    """The HTTP status the handlers below answer ``exc`` with (for the audit trail)."""
    if isinstance(exc, ApiError):
        return exc.status
    for types, status in _STATUS.items():
        if isinstance(exc, types):
            return status
    return 500


def error_response(status: int, code: str, message: str, headers: dict | None = None, **extra) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, **extra}, status_code=status, headers=headers)


def allowed_methods(request: Request) -> list[str] | None:
    """Every method the API documents on the request's path (its OpenAPI paths, where a ``{param}``
    is one path segment); None for a path outside them (the console's, the docs')."""
    import re

    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)), request.url.path):
            methods |= {m.upper() for m in operations}
    return sorted(methods) or None


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        headers = {**({"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}), **(exc.headers or {})}
        return error_response(exc.status, exc.code, exc.message, headers or None, **exc.extra)

    def _plain(status: int, code: str):
        async def handler(request: Request, exc: Exception):
            return error_response(status, code, str(exc))
        return handler

    # A store or scheduler exception is an answer of its own: (status, code), the message its text.
    for exc_type, status, code in ((UnknownJob, 404, "job_not_found"), (NeverFits, 409, "never_fits"),
                                   (UnknownUser, 404, "user_not_found"), (UserExists, 409, "user_conflict"),
                                   (JobNotActive, 409, "job_not_active")):
        app.add_exception_handler(exc_type, _plain(status, code))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            where = next(e for e in errors if e.get("type") == "json_invalid")
            detail = (where.get("ctx") or {}).get("error", "")
            return error_response(400, "invalid_json", f"the request body is not valid JSON: {detail}".rstrip(": "))
        problems = [{"field": ".".join(str(x) for x in e["loc"] if x != "body"), "message": e["msg"]} for e in errors]
        return error_response(422, "invalid_request", "; ".join(f"{p['field']}: {p['message']}" for p in problems),
                              errors=problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see /docs"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route that matched the path only;
            # /jobs is two routes (GET lists, POST submits): name every one
            allowed = allowed_methods(request)
            if allowed:
                headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            allowed_text = (headers or {}).get("Allow", "see /docs")
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {allowed_text}"
        return error_response(exc.status_code, code, message, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug: logged, answered without a traceback
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", f"internal error ({type(exc).__name__}); see the server log")
