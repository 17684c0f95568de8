"""The web console (``GET /``): a static shell and its files, plus one helper the page needs.

Everything the console shows comes from the REST API (``/api/v1``), fetched by the page with
``Authorization: Bearer <token>``; the token is asked for once and kept in the tab's
``sessionStorage``, never put in a URL. Only the shell (``/``) and its static files
(``/static/...``: HTML, CSS, JS; no build step, nothing from the network) are served without
the token. ``POST /console/yaml`` turns a pasted or uploaded YAML spec into JSON for the
page (the browser has no YAML parser); it needs the token like the API.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from api.rest.deps import require_token
from api.rest.errors import ApiError

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter(tags=["console"])


@router.get("/", include_in_schema=False)
def shell() -> FileResponse:
    """The console's HTML shell; it holds no data, so it needs no token."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.post("/console/yaml", dependencies=[Depends(require_token)], include_in_schema=False)
async def yaml_to_json(request: Request):
    """A YAML (or JSON: YAML's subset) document as JSON; 400 with the line and column when it does not parse."""
    text = (await request.body()).decode(errors="replace")
    try:
        return {"spec": yaml.safe_load(text)}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ApiError(400, "invalid_yaml", f"the spec is not valid YAML{where}: {problem}") from None


def install(app: FastAPI) -> None:
    """Serve the console on ``app``: ``/``, ``/static/*`` and ``/console/yaml``."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
