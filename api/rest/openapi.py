"""The OpenAPI document (``/openapi.json``, drawn at ``/docs``) made true to what the server answers.

FastAPI's own document is the start; :func:`install` completes it where it cannot know better:

* the job spec of ``POST /jobs`` and ``POST /plan`` is :class:`service.spec.spec.JobSpec`'s schema
  (the routes read the body themselves, so that a 422 lists one entry per problem);
* every error status an operation can answer is listed with :class:`api.rest.schemas.ErrorBody`, the
  body every error has (never FastAPI's ``HTTPValidationError``, which this server never sends):
  401 everywhere the token is needed, 404 where a job id is in the path, 400/413/422 where a body
  is read, 422 where parameters are; and none it cannot answer.

``tests/api/rest/test_api_fuzz.py`` holds the document to this: schemathesis ``--checks all`` against a real
server finds nothing.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.rest.schemas import ErrorBody

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
_WHY = {400: "malformed request (e.g. the body is not JSON, an invalid Content-Length)",
        401: "missing, wrong or revoked API token", 403: "the route needs an admin's token",
        404: "no such job or user (another user's job included), or no such route",
        409: "the request conflicts with the job's or the cluster's state", 413: "the request body is too large",
        422: "invalid parameters or spec (one entry per problem in `errors`)",
        429: "too many submissions (see Retry-After) or queued jobs"}


def install(app: FastAPI) -> None:
    """Replace ``app.openapi`` by the completed document (built once)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = complete(get_openapi(title=app.title, version=app.version,
                                                      description=app.description, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi


def complete(doc: dict) -> dict:
    """``doc`` with the job spec typed and the error statuses of every operation as they are."""
    from service.spec.spec import JobSpec

    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    spec = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(spec.pop("$defs", {}))
    spec["minProperties"] = 1  # parse_spec refuses an empty spec
    schemas["JobSpec"] = spec
    schemas.setdefault("ErrorBody", ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}"))
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            body = "requestBody" in op
            if body and "x-raytron-spec" in op:
                op["requestBody"]["content"]["application/json"]["schema"] = {"$ref": "#/components/schemas/JobSpec"}
                del op["x-raytron-spec"]
            codes = {int(c) for c in responses if c.isdigit() and int(c) >= 400} - {400, 404, 413, 422}
            if op.get("security"):
                codes.add(401)
            if "{job_id}" in path or "{name}" in path:  # another user's job is a 404 too
                codes.add(404)
            if body:
                codes |= {400, 413, 422}
            if any(p.get("in") != "path" for p in op.get("parameters", [])):  # a path's job id is any string
                codes.add(422)
            for param in op.get("parameters", []):
                # an optional query or header is left out, never sent as null: "null" is no integer
                any_of = param.get("schema", {}).get("anyOf")
                if param.get("in") in ("query", "header") and any_of and {"type": "null"} in any_of:
                    rest = [x for x in any_of if x != {"type": "null"}]
                    if len(rest) == 1:
                        param["schema"] = {**{k: v for k, v in param["schema"].items() if k != "anyOf"}, **rest[0]}
            for code in [c for c in responses if c.isdigit() and int(c) >= 400]:
                del responses[code]
            for code in sorted(codes):
                responses[str(code)] = {"description": _WHY.get(code, "error"),
                                        "content": {"application/json": {"schema": ERROR_REF}}}
    return doc
