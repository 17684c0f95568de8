"""The data dir: where ``raytron serve`` keeps job logs, the token file and (by default) the
database, and where the CLI client looks for the token. ``--data-dir`` wins, then
``$RAYTRON_DATA_DIR``, then ``~/.raytron``."""

from __future__ import annotations

import os

DEFAULT_DATA_DIR = "~/.raytron"


def data_dir_default() -> str:
    """``$RAYTRON_DATA_DIR``, else :data:`DEFAULT_DATA_DIR` (``~`` not expanded)."""
    return os.environ.get("RAYTRON_DATA_DIR") or DEFAULT_DATA_DIR
