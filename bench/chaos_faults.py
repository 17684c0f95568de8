"""The chaos drill's parts (bench/chaos.py): `raytron serve --simulate 4x2` as a killable child, the
faults made to happen, and what the job's events say about each one's recovery."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from service.ranks.proc_tree import descendants, matching
from workers.rank.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "chaos-token-0123456789abcdef"
NODES, GPUS = 4, 2


class Server:
    """`raytron serve --simulate 4x2 --launcher ray` as a child process, killable and restartable."""

    def __init__(self, data_dir: Path, drills: list[str]):
        self.data_dir, self.drills = data_dir, drills
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api/v1"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 240) -> None:
        import httpx

        args = [sys.executable, "-m", "api.cli.serve_cmd", "--port", str(self.port), "--simulate", f"{NODES}x{GPUS}",
                "--launcher", "ray", "--data-dir", str(self.data_dir), "--log-level", "warning"]
        for d in self.drills:
            args += ["--fault", d]
        log = open(self.data_dir / "serve.log", "ab")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=log,
                                     env={**os.environ, "RAYTRON_API_TOKEN": TOKEN})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"raytron serve exited: see {self.data_dir / 'serve.log'}")
            time.sleep(0.2)
        raise RuntimeError("raytron serve did not answer")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def get(self, path: str, **params):
        import httpx

        for _ in range(600):  # the server may be restarting
            try:
                r = httpx.get(self.url + path, params=params, headers={"Authorization": f"Bearer {TOKEN}"},
                              timeout=30)
                r.raise_for_status()
                return r.json()
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError(f"GET {path} kept failing")


def raylet_of(node_id: str) -> int | None:
    found = matching(lambda a: a[0].endswith("raylet") and f"--node_id={node_id}" in a)
    return found[0] if found else None


def add_node(data_dir: Path) -> None:
    """A node joins the server's cluster as a machine joins a real one (stopped with the cluster)."""
    from service.ranks.ray_cluster import join_simulated_cluster

    join_simulated_cluster(data_dir / "ray_cluster.json", GPUS)


# ---------------------------------------------------------------------------------------------
def inject(fault: dict, server: Server, job_id: str) -> str:
    """Make the fault happen; returns what was hit."""
    rng = random.Random(fault["victim_seed"])
    ranks = server.get(f"/jobs/{job_id}/placement")["ranks"]
    kind = fault["kind"]
    if kind in ("rank_kill", "rank_stop"):
        victim = rng.choice(ranks)
        os.kill(victim["pid"], signal.SIGKILL if kind == "rank_kill" else signal.SIGSTOP)
        return f"rank {victim['rank']} (pid {victim['pid']})"
    if kind == "node_loss":
        node_id = rng.choice(sorted({r["node_id"] for r in ranks}))
        # A machine that is lost takes all its processes with it. The raylet alone is not enough: its rank
        # processes would train on until Ray noticed, and a job near its end could finish first (seen in CI).
        raylet = raylet_of(node_id)
        for pid in [raylet, *descendants({raylet}), *(r["pid"] for r in ranks if r["node_id"] == node_id)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return f"node {node_id[:8]}"
    if kind == "runner_kill":
        pids = matching(lambda a: a[0].endswith("python") and a[1:4] == ["-m", "service.server.job_main", job_id])
        os.kill(pids[0], signal.SIGKILL)
        return f"runner (pid {pids[0]})"
    if kind == "server_kill":
        server.kill()
        server.start()
        return "raytron serve"
    return f"rank {fault['rank']} while saving"  # save_crash: the server's drill fires by itself


def recovery(server: Server, job_id: str, after_seq: int, t0: float, kind: str) -> tuple[float, int] | None:
    """(seconds from the fault to the next finished iteration after it, iterations lost), or None."""
    log = server.get(f"/jobs/{job_id}/events", after=after_seq)["events"]
    before = [e["data"]["iteration"] for e in server.get(f"/jobs/{job_id}/events")["events"]
              if e["kind"] == "iteration" and e["seq"] <= after_seq]
    broke = next((i for i, e in enumerate(log) if e["kind"] in ("failure", "runner", "resize")
                  or (e["kind"] == "state" and e["state"] == "RESTARTING")), None)
    if kind == "server_kill":
        broke = -1  # the runner goes on: the next iteration the new server sees
    if broke is None:
        return None
    done = [e for e in log[broke + 1:] if e["kind"] == "iteration"]
    if not done:
        return None
    last = max([e["data"]["iteration"] for e in log[:broke + 1] if e["kind"] == "iteration"] + before + [0])
    return max(0.0, done[0]["time"] - t0), max(0, last - (done[0]["data"]["iteration"] - 1))


def shrunk_to(server: Server, job_id: str, dp: int) -> bool:
    """Whether the job recorded a resize to ``dp`` data-parallel replicas."""
    events = server.get(f"/jobs/{job_id}/events", kind="resize")["events"]
    return any(((e.get("data") or {}).get("new") or {}).get("sizes", {}).get("dp") == dp for e in events)


def wait_until(server: Server, job_id: str, pred, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = server.get(f"/jobs/{job_id}")
        if pred(job):
            return job
        if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            raise RuntimeError(f"job {job['state']} while waiting for {what}: {job.get('error')}")
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")
