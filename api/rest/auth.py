"""The bootstrap admin's API token: from ``RAYTRON_API_TOKEN``, else a file in the data dir created on first start.

Other users' tokens are issued by the server (:mod:`service.server.accounts`); a client reads
its own from ``RAYTRON_API_TOKEN`` like this one.

The file (``DATA_DIR/api_token``, mode 0600) is what the CLI reads when the variable is unset.
Comparison is constant-time (:func:`hmac.compare_digest`); the token is never logged or returned.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV_VAR = "RAYTRON_API_TOKEN"
TOKEN_FILE = "api_token"


def token_path(data_dir: str | Path) -> Path:
    return Path(data_dir).expanduser() / TOKEN_FILE


def read_token(data_dir: str | Path | None = None, env: dict | None = None) -> str | None:
    """The token a client should send: the environment's, else the data dir's file, else None."""
    env = os.environ if env is None else env
    if env.get(ENV_VAR):
        return env[ENV_VAR]
    if data_dir is None:
        return None
    try:
        return token_path(data_dir).read_text().strip() or None
    except OSError:
        return None


def load_or_create_token(data_dir: str | Path, env: dict | None = None) -> str:
    """The server's token: the environment's, else the file's, created (0600) when missing."""
    token = read_token(data_dir, env)
    if token:
        return token
    path = token_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        # O_EXCL: two servers starting at once must not each write their own token
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for none or another scheme."""
    if not header:
        return None
    scheme, _, given = header.partition(" ")
    return given.strip() or None if scheme.lower() == "bearer" else None

