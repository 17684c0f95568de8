"""Users, their tokens and the audit trail, in the job store's database (schema v3).

* A **user** has a name, an ``admin`` flag, a ``gpu_quota`` (the GPU slots its running jobs may
  hold together; None: no quota) and a ``max_priority`` (the highest queue priority it may give a
  job; None: no cap). The bootstrap admin (:data:`BOOTSTRAP_ADMIN`) is the user of
  ``RAYTRON_API_TOKEN`` / ``DATA_DIR/api_token``: that token is compared as before, never stored.
* A **token** is 32 random bytes (``secrets.token_urlsafe``), shown once when it is created. The
  database keeps only ``HMAC-SHA256(server secret, token)``; the secret is a file of the data dir
  (``token_secret``, mode 0600), so a copy of the database alone gives no token and no way to test
  guesses. A presented token is looked up by its digest and the digests compared in constant time.
* The **audit** trail: one row per action (submit, cancel, user changes) and per refused attempt
  (a bad token, an over-quota or rate-limited submission, a cancel of a job that is not the
  caller's), with the user, the target, the HTTP status and details; never a token.

Lookups are cached in memory and the cache is dropped on every change made here (every change
goes through the one server process), so a revoked token is refused at once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from service.server.store import JobStore
from service.server.store_schema import BOOTSTRAP_ADMIN, audit, jobs, tokens, users

SECRET_FILE = "token_secret"


@dataclass(frozen=True)
class User:
    name: str
    admin: bool = False
    gpu_quota: int | None = None
    max_priority: int | None = None

    def public(self) -> dict:
        return {"name": self.name, "admin": self.admin, "gpu_quota": self.gpu_quota, "max_priority": self.max_priority}


class UserExists(ValueError):
    """A user of that name exists already (HTTP 409)."""


class UnknownUser(LookupError):
    """No user of that name (HTTP 404)."""


def load_or_create_secret(data_dir: str | Path) -> bytes:
    """The server's HMAC key for token digests: ``DATA_DIR/token_secret`` (0600), created when missing."""
    path = Path(data_dir).expanduser() / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return bytes.fromhex(path.read_text().strip())
    secret = secrets.token_bytes(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


class Accounts:
    """Users, tokens and the audit trail over a :class:`JobStore`'s database.

    Args:
        store: the job store (its engine and tables).
        secret: the HMAC key of the token digests (:func:`load_or_create_secret`).
        bootstrap_token: the token of the bootstrap admin (never stored).
    """

    def __init__(self, store: JobStore, secret: bytes, bootstrap_token: str):
        self.store, self._secret, self._bootstrap = store, secret, bootstrap_token
        self._lock = threading.Lock()
        self._by_digest: dict[str, User] = {}
        self._users: dict[str, User | None] = {}
        self._owners: dict[str, str] = {}  # job id -> owner (an owner never changes)
        with store._write() as conn:
            if conn.execute(sa.select(users.c.name).where(users.c.name == BOOTSTRAP_ADMIN)).first() is None:
                conn.execute(users.insert().values(name=BOOTSTRAP_ADMIN, admin=True, created_at=time.time()))
        self._admin = User(BOOTSTRAP_ADMIN, admin=True)  # its quota and cap do not apply: an admin has none

    # ---- tokens -------------------------------------------------------------------------------
    def digest(self, token: str) -> str:
        return hmac.new(self._secret, token.encode(), hashlib.sha256).hexdigest()

    def cached(self, token: str | None) -> User | None:
        """The user of the bootstrap token or of a token seen before (no database read), else None."""
        if not token:
            return None
        if hmac.compare_digest(token.encode(), self._bootstrap.encode()):
            return self._admin
        with self._lock:
            return self._by_digest.get(self.digest(token))

    def authenticate(self, token: str | None) -> User | None:
        """The user a presented token belongs to, or None (missing, unknown or revoked)."""
        if not token:
            return None
        known = self.cached(token)
        if known is not None:
            return known
        digest = self.digest(token)
        query = (sa.select(tokens.c.digest, users).join(users, users.c.name == tokens.c.user)
                 .where((tokens.c.digest == digest) & tokens.c.revoked_at.is_(None)))
        with self.store.engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        if row is None or not hmac.compare_digest(row["digest"], digest):
            return None
        user = _user(row)
        with self._lock:
            self._by_digest[digest] = user
        return user

    def _issue(self, conn, name: str) -> str:
        token = "rt_" + secrets.token_urlsafe(32)
        conn.execute(tokens.insert().values(user=name, digest=self.digest(token), created_at=time.time()))
        return token

    # ---- users --------------------------------------------------------------------------------
    def add_user(self, name: str, *, admin: bool = False, gpu_quota: int | None = None,
                 max_priority: int | None = None) -> tuple[User, str]:
        """Create a user and its first token; returns both (the token is not kept anywhere)."""
        with self.store._write() as conn:
            if conn.execute(sa.select(users.c.name).where(users.c.name == name)).first() is not None:
                raise UserExists(f"user {name!r} exists already; choose another name, or `raytron users token "
                                 f"{name}` for a new token")
            conn.execute(users.insert().values(name=name, admin=admin, gpu_quota=gpu_quota, max_priority=max_priority,
                                               created_at=time.time()))
            token = self._issue(conn, name)
        self._forget()
        return User(name, admin, gpu_quota, max_priority), token

    def user(self, name: str) -> User | None:
        with self._lock:
            if name in self._users:
                return self._users[name]
        with self.store.engine.connect() as conn:
            row = conn.execute(sa.select(users).where(users.c.name == name)).mappings().first()
        user = _user(row) if row is not None else None
        with self._lock:
            self._users[name] = user
        return user

    def list_users(self) -> list[dict]:
        """Every user with its number of live tokens (the bootstrap admin's is not counted: it is not stored)."""
        live = (sa.select(sa.func.count()).where((tokens.c.user == users.c.name) & tokens.c.revoked_at.is_(None))
                .scalar_subquery().label("tokens"))
        with self.store.engine.connect() as conn:
            rows = conn.execute(sa.select(users, live).order_by(users.c.created_at, users.c.name)).mappings().all()
        return [{**_user(r).public(), "tokens": r["tokens"], "created_at": r["created_at"]} for r in rows]

    def new_token(self, name: str) -> str:
        """One more token for the user (its others keep working)."""
        with self.store._write() as conn:
            self._require(conn, name)
            token = self._issue(conn, name)
        self._forget()
        return token

    def revoke(self, name: str) -> int:
        """Revoke every token of the user (refused at once); returns how many were live."""
        with self.store._write() as conn:
            self._require(conn, name)
            live = (tokens.c.user == name) & tokens.c.revoked_at.is_(None)
            n = conn.execute(tokens.update().where(live).values(revoked_at=time.time())).rowcount
        self._forget()
        return n

    def remove(self, name: str) -> None:
        """Delete the user and its tokens; its jobs stay (and keep its name as their owner)."""
        if name == BOOTSTRAP_ADMIN:
            raise UserExists(f"user {name!r} is the bootstrap admin (RAYTRON_API_TOKEN / DATA_DIR/api_token) and "
                             f"cannot be removed; change that token to lock it out")
        with self.store._write() as conn:
            self._require(conn, name)
            conn.execute(tokens.delete().where(tokens.c.user == name))
            conn.execute(users.delete().where(users.c.name == name))
        self._forget()

    def gpu_quota(self, name: str) -> int | None:
        user = self.user(name)
        return user.gpu_quota if user is not None else None

    def owner_of(self, job_id: str) -> str | None:
        """The job's owner (None: no such job); cached, since it never changes."""
        with self._lock:
            if job_id in self._owners:
                return self._owners[job_id]
        with self.store.engine.connect() as conn:
            owner = conn.execute(sa.select(jobs.c.owner).where(jobs.c.id == job_id)).scalar()
        if owner is not None:
            with self._lock:
                if len(self._owners) > 100_000:
                    self._owners.clear()
                self._owners[job_id] = owner
        return owner

    def queued_jobs(self, name: str) -> int:
        with self.store.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).where((jobs.c.owner == name) & (jobs.c.state == "QUEUED"))
                                ).scalar_one()

    # ---- audit --------------------------------------------------------------------------------
    def record(self, user: str | None, action: str, target: str | None, status: int, **detail) -> None:
        """Append one audit entry (the caller never passes a token: none reaches here)."""
        with self.store._write() as conn:
            conn.execute(audit.insert().values(time=time.time(), user=user, action=action, target=target,
                                               status=status, detail=detail or None))

    def audit(self, *, limit: int = 100, before: int | None = None, user: str | None = None,
              action: str | None = None) -> list[dict]:
        """Audit entries, newest first; ``before``: only entries with a smaller id (the next page)."""
        query = sa.select(audit).order_by(audit.c.id.desc()).limit(limit)
        if before is not None:
            query = query.where(audit.c.id < before)
        if user is not None:
            query = query.where(audit.c.user == user)
        if action is not None:
            query = query.where(audit.c.action == action)
        with self.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(query).mappings()]

    # ---- internals ----------------------------------------------------------------------------
    def _require(self, conn, name: str) -> None:
        if conn.execute(sa.select(users.c.name).where(users.c.name == name)).first() is None:
            raise UnknownUser(f"no user {name!r}; `raytron users list` shows them")

    def _forget(self) -> None:
        with self._lock:
            self._by_digest.clear()
            self._users.clear()


def _user(row) -> User:
    return User(row["name"], bool(row["admin"]), row["gpu_quota"], row["max_priority"])
