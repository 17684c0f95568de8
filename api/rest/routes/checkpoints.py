"""``GET /api/v1/jobs/{id}/checkpoints``: a job's complete checkpoints, read from where they are stored.

Each is listed with its iteration, the metrics saved with it (``val_loss``, ``lm_loss``), its size, its
format and its location, and why retention keeps it (``checkpoint.keep_last`` / ``keep_best``), the
same rule that pruned the others (:func:`workers.checkpoint.storage.retained`).
"""

from __future__ import annotations

import os

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.rest.deps import SettingsDep, StoreDep
from api.rest.routes.jobs import get_row
from api.rest.schemas import CheckpointList, ErrorBody
from service.spec.stored import stored_section

router = APIRouter(prefix="/jobs", tags=["jobs"])
_ERRORS = {401: {"model": ErrorBody}, 404: {"model": ErrorBody}}


def checkpoint_root(row: dict, data_dir) -> str:
    """Where a served job saves: its ``checkpoint.dir``, else ``DATA_DIR/checkpoints/JOB_ID`` (as the
    server's runners give it)."""
    return stored_section(row["spec"], "checkpoint").dir or os.path.join(str(data_dir), "checkpoints", row["id"])


def list_job_checkpoints(row: dict, data_dir) -> dict:
    from workers.checkpoint.storage import Storage, list_checkpoints, metric_of, retained

    c = stored_section(row["spec"], "checkpoint")
    root = checkpoint_root(row, data_dir)
    found = list_checkpoints(Storage.from_uri(root)) if c.save_interval else []
    why = retained(found, c.keep_last, c.keep_best, c.best_metric)
    return {"job_id": row["id"], "root": root, "keep_last": c.keep_last, "keep_best": c.keep_best,
            "best_metric": c.best_metric,
            "checkpoints": [{"iteration": info.iteration, "location": info.storage.uri,
                             "format": info.manifest.get("format"),
                             "metrics": {k: v for k in ("val_loss", "lm_loss") if (v := metric_of(info, k)) is not None},
                             "size_bytes": sum(f["size"] for f in info.manifest.get("files", {}).values()),
                             "kept_because": why.get(info.iteration)} for info in found]}


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, responses=_ERRORS)
async def get_checkpoints(job_id: str, store: StoreDep, settings: SettingsDep) -> dict:
    """The job's complete checkpoints, oldest first, with the metric each was saved with and why it is
    kept (an incomplete save is not listed)."""
    row = get_row(store, job_id)
    return await run_in_threadpool(list_job_checkpoints, row, settings.data_dir)
