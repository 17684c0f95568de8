"""A real raytron server for tests: started as users start it (`raytron serve`), on a free port, with a token; small jobs and waits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.helpers.paths import ROOT
from workers.rank.distributed import free_port

TOKEN = "test-token-0123456789abcdef"


def tiny(name="tiny", world=2, iters=3, priority=None, **parallel) -> dict:
    spec = {"name": name,
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                      "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 16},
            "parallel": parallel,
            "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-3, "seed": 7},
            "resources": {"num_nodes": 1, "gpus_per_node": world}}
    if priority is not None:
        spec["priority"] = priority
    return spec


class Server:
    """``raytron serve`` as a child process; ``start`` waits until it answers /healthz."""

    def __init__(self, data_dir: Path, *, simulate: str | None = "1x2", token: str | None = TOKEN,
                 launcher: str = "processes", start_timeout_s: float = 60, extra_args: tuple[str, ...] = (),
                 env: dict | None = None):
        # processes: admission against a static NODESxGPUS cluster, runners as local processes;
        # ray: a simulated Ray cluster of that shape, jobs as Ray Jobs (slower to start);
        # simulate None with ray: the cluster RAY_ADDRESS (in env) names;
        # extra_args: more serve flags (e.g. --fault drills); env: the server's environment
        self.data_dir, self.simulate, self.token, self.launcher = Path(data_dir), simulate, token, launcher
        self.start_timeout_s, self.extra_args, self.env = start_timeout_s, tuple(extra_args), env or dict(os.environ)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = self.data_dir / "serve.log"

    def start(self) -> "Server":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in self.env.items() if k != "RAYTRON_API_TOKEN"}
        if self.token:
            env["RAYTRON_API_TOKEN"] = self.token
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "api.cli.serve_cmd", "--port", str(self.port),
                                          *(("--simulate", self.simulate) if self.simulate else ()),
                                          "--launcher", self.launcher,
                                          "--data-dir", str(self.data_dir),
                                          "--log-level", "info", *self.extra_args], cwd=ROOT, env=env,
                                         stdout=log, stderr=log)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            time.sleep(0.1)
        raise AssertionError(f"server did not start: {self.log.read_text()[-4000:]}")

    def client(self, token: str | None = None) -> httpx.Client:
        token = token or self.token or (self.data_dir / "api_token").read_text().strip()
        return httpx.Client(base_url=f"{self.url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def stop(self, sig=signal.SIGTERM) -> None:
        """Stop the server; the job runners it started keep running (as in production)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def kill_runners(self) -> None:
        """Kill every job runner (and its ranks) the servers on this data dir left behind."""
        for record in self.data_dir.glob("jobs/*/runner.json"):
            pid = json.loads(record.read_text()).get("pid")
            if pid and pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@contextlib.contextmanager
def a_held_slot(srv: Server) -> Iterator[tuple[str, int]]:
    """A job that holds the server's slot without its CPU (its runner's process group stopped with
    SIGSTOP; running ranks would take a core from the server). Yields (its id, its runner's pid);
    the runner is continued and killed on the way out, whatever happened."""
    runner = None
    try:
        with srv.client() as api:
            blocker = api.post("/jobs", json=tiny("blocker", world=1, iters=10 ** 7)).json()["id"]
            wait_for(api, blocker, ("STARTING", "RUNNING"))
        runner = json.loads((srv.data_dir / "jobs" / blocker / "runner.json").read_text())["pid"]
        os.killpg(runner, signal.SIGSTOP)
        yield blocker, runner
    finally:
        if runner is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(runner, sig)


def wait_for(client: httpx.Client, job_id: str, states, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {job['state']} after {timeout_s}s")


def job_losses(client: httpx.Client, job_id: str, page: int = 10000) -> list[float]:
    """The job's whole loss curve, one value per iteration, walked page by page (``next_after``)."""
    losses, after = [], 0
    while after is not None:
        body = client.get(f"/jobs/{job_id}/metrics", params={"names": "loss", "after": after, "limit": page}).json()
        losses += body["loss"]
        after = body["next_after"]
    return losses


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def module_server(tmp_path_factory, name: str, *, clean_log: bool = True):
    """A module's server (the body of a module-scoped fixture): started in a fresh data dir, then
    stopped with every runner it left; ``clean_log``: its log must hold no traceback."""
    srv = Server(tmp_path_factory.mktemp(name)).start()
    yield srv
    srv.stop()
    srv.kill_runners()
    if clean_log:
        assert "Traceback" not in srv.log.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(tmp_path_factory, "api")


@pytest.fixture
def api(server):
    with server.client() as c:
        yield c
