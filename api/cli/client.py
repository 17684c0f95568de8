"""A small HTTP client of the REST API (``/api/v1``), used by ``raytron submit/status/logs/cancel``.

The token comes from the argument, else ``RAYTRON_API_TOKEN``, else the ``api_token`` file in the
data dir (``--data-dir``, ``$RAYTRON_DATA_DIR`` or ``~/.raytron``) that ``raytron serve`` wrote.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterator

import httpx

from api.rest.auth import read_token
from api.cli.data_dir import data_dir_default

DEFAULT_SERVER = "http://127.0.0.1:8000"


class ApiClientError(Exception):
    """The server refused a request: HTTP ``status``, its stable ``code`` and per-problem ``errors``."""

    def __init__(self, status: int, code: str, message: str, errors: list | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.errors = status, code, message, errors or []


class ServerUnreachable(Exception):
    """No answer from the server (not started, wrong ``--server``)."""


class RaytronClient:
    """Calls of the REST API; every method returns the JSON body or raises :class:`ApiClientError`.

    Args:
        server: base URL; default ``$RAYTRON_SERVER`` or ``http://127.0.0.1:8000``.
        token: the API token; default from the environment or the data dir.
        data_dir: where ``raytron serve`` keeps its token file.
    """

    def __init__(self, server: str | None = None, *, token: str | None = None, data_dir: str | None = None,
                 timeout_s: float = 30.0):
        self.server = (server or os.environ.get("RAYTRON_SERVER") or DEFAULT_SERVER).rstrip("/")
        token = token or read_token(os.path.expanduser(data_dir or data_dir_default()))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=f"{self.server}/api/v1", headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "RaytronClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw):
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ServerUnreachable(f"cannot reach the raytron server at {self.server} ({e}); start it with "
                                    f"`raytron serve` or pass --server URL") from None
        return self._body(r)

    @staticmethod
    def _body(r: httpx.Response):
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = {"code": "http_error", "message": r.text[:200] or r.reason_phrase}
            raise ApiClientError(r.status_code, body.get("code", "error"), body.get("message", ""), body.get("errors"))
        if r.headers.get("content-type", "").startswith("application/json"):
            return r.json()
        return r.text

    def submit(self, spec: dict) -> dict:
        return self._call("POST", "/jobs", json=spec)

    def jobs(self, limit: int = 100) -> list[dict]:
        """The newest ``limit`` jobs (the first page)."""
        return self.jobs_page(limit=limit)["jobs"]

    def jobs_page(self, *, limit: int = 100, cursor: str | None = None, state: str | None = None,
                  name: str | None = None) -> dict:
        """One page of the job list: ``{"jobs", "count", "next_cursor"}``."""
        params = {k: v for k, v in (("limit", limit), ("cursor", cursor), ("state", state), ("name", name))
                  if v is not None}
        return self._call("GET", "/jobs", params=params)

    def metrics(self, job_id: str, *, names: list[str] | None = None, after: int = 0, limit: int | None = None,
                points: int | None = None) -> dict:
        """A page of the job's per-iteration metrics (or, with ``points``, the downsampled curve)."""
        params = {"after": after, **({"names": ",".join(names)} if names is not None else {}),
                  **({"limit": limit} if limit is not None else {}), **({"points": points} if points else {})}
        return self._call("GET", f"/jobs/{job_id}/metrics", params=params)

    def curve(self, job_id: str, names: list[str] | None = None, page: int = 10000) -> dict:
        """The job's whole curves, page by page (each iteration once): ``{"iterations": [...], name: [...]}``."""
        out: dict = {}
        after: int | None = 0
        while after is not None:
            got = self.metrics(job_id, names=names, after=after, limit=page)
            for key, values in got.items():
                if isinstance(values, list):
                    out.setdefault(key, []).extend(values)
            after = got["next_after"]
        return out

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/jobs/{job_id}")

    def placement(self, job_id: str) -> dict:
        return self._call("GET", f"/jobs/{job_id}/placement")

    def events(self, job_id: str, after: int = 0) -> list[dict]:
        return self._call("GET", f"/jobs/{job_id}/events", params={"after": after})["events"]

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/jobs/{job_id}/cancel")

    def plan(self, spec: dict) -> dict:
        return self._call("POST", "/plan", json=spec)

    def cluster(self) -> dict:
        return self._call("GET", "/cluster")

    # ---- users and the audit trail (admins) --------------------------------------------------
    def me(self) -> dict:
        return self._call("GET", "/me")

    def add_user(self, name: str, *, admin: bool = False, gpu_quota: int | None = None,
                 max_priority: int | None = None) -> dict:
        """``{"name", "token"}``: the token is shown this once."""
        return self._call("POST", "/users", json={"name": name, "admin": admin, "gpu_quota": gpu_quota,
                                                  "max_priority": max_priority})

    def users(self) -> list[dict]:
        return self._call("GET", "/users")["users"]

    def new_token(self, name: str) -> dict:
        return self._call("POST", f"/users/{name}/tokens")

    def revoke(self, name: str) -> dict:
        return self._call("POST", f"/users/{name}/revoke")

    def remove_user(self, name: str) -> None:
        self._call("DELETE", f"/users/{name}")

    def audit(self, *, limit: int = 100, user: str | None = None, action: str | None = None,
              cursor: str | None = None) -> dict:
        params = {k: v for k, v in (("limit", limit), ("user", user), ("action", action), ("cursor", cursor))
                  if v is not None}
        return self._call("GET", "/audit", params=params)

    def logs(self, job_id: str, offset: int = 0) -> str:
        return self._call("GET", f"/jobs/{job_id}/logs", params={"offset": offset})

    def follow_events(self, job_id: str, *, after: int = 0, reconnects: int = 20) -> Iterator[dict]:
        """The job's events after seq ``after`` (0: all), live (SSE), until it ends; reconnects after a
        dropped connection and resumes after the last event seen (``Last-Event-ID``), so nothing
        arrives twice."""
        last, failures = after, 0
        while True:  # a stream the server ended before the job's end (serve --max-stream-s) is resumed too
            try:
                headers = {"Accept": "text/event-stream", **({"Last-Event-ID": str(last)} if last else {})}
                with self.http.stream("GET", f"/jobs/{job_id}/events", headers=headers, timeout=None) as r:
                    if r.status_code >= 400:
                        r.read()
                        self._body(r)
                    fields: dict[str, str] = {}
                    for line in r.iter_lines():
                        if line:
                            if not line.startswith(":"):
                                key, _, value = line.partition(": ")
                                fields[key] = value
                            continue
                        if fields.get("event") == "end":
                            return
                        if "data" in fields:
                            event = json.loads(fields["data"])
                            last = event["seq"]
                            yield event
                        fields = {}
            except httpx.TransportError:
                failures += 1
                if failures > reconnects:
                    raise ServerUnreachable(f"lost the event stream of job {job_id} at {self.server}") from None
                time.sleep(min(5.0, 0.5 * failures))

    def follow_logs(self, job_id: str) -> Iterator[str]:
        try:
            with self.http.stream("GET", f"/jobs/{job_id}/logs", params={"follow": "true"}, timeout=None) as r:
                if r.status_code >= 400:
                    r.read()
                    self._body(r)
                yield from r.iter_text()
        except httpx.TransportError as e:
            raise ServerUnreachable(f"lost the log stream of job {job_id} at {self.server} ({e})") from None
