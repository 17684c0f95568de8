"""Where a job's files live under the data dir, and reading its log from an offset.

Layout (one folder per job, created by the launcher that starts the job)::

    DATA_DIR/jobs/JOB_ID/driver.log    the job process's stdout and stderr; the rank processes it
                                       starts inherit them, so their output is here too
    DATA_DIR/jobs/JOB_ID/runner.json   how the launcher finds the job's process again after a
                                       server restart (pid and start time, or the Ray job id)

A launcher that runs the job elsewhere (a Ray Job) copies what the job prints into
``driver.log`` as it reads it, so that ``GET /api/v1/jobs/{id}/logs`` has one place to read.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def job_dir(data_dir: str | Path, job_id: str) -> Path:
    """The job's folder (not created). Refuses ids that could leave ``DATA_DIR/jobs``: one path
    component, no ``/``, not ``.`` or ``..`` (the first character is a letter or digit); ``a..b``
    is an ordinary name (a job named so by its spec must have a log like any other)."""
    if not _SAFE_ID.match(job_id):
        raise ValueError(f"job id {job_id!r} is not a valid job id")
    return Path(data_dir) / "jobs" / job_id


def log_path(data_dir: str | Path, job_id: str) -> Path:
    return job_dir(data_dir, job_id) / "driver.log"


def read_log(path: Path, offset: int = 0, limit: int = 1 << 20) -> tuple[bytes, int]:
    """Up to ``limit`` bytes of the log from ``offset``; returns (bytes, next offset). A log that
    does not exist yet, and any offset past the end (even one the file system cannot seek to),
    read as empty."""
    try:
        with open(path, "rb") as f:
            if offset >= os.fstat(f.fileno()).st_size:
                return b"", offset
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return b"", offset
    return data, offset + len(data)


def write_runner(data_dir: str | Path, job_id: str, record: dict) -> None:
    """Store the launcher's record of the job's runner (atomically: a restart never reads half of it)."""
    folder = job_dir(data_dir, job_id)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "runner.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / "runner.json")


def read_runner(data_dir: str | Path, job_id: str) -> dict | None:
    try:
        return json.loads((job_dir(data_dir, job_id) / "runner.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
