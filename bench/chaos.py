"""Chaos drill: one long job through `raytron serve --simulate 4x2` (jobs as Ray Jobs, the path
`make run` takes) while seeded faults hit it, then the job's curve against an undisturbed run.

    python -m bench.chaos --seed 1 --faults 12

The job is tp2 x dp4 on 4 nodes x 2 GPU slots, a checkpoint every 2 iterations, min_nodes 2.
Each fault is drawn (seeded: which kind, at which iteration, which victim) from

* ``rank_kill``   SIGKILL of a rank's process;
* ``rank_stop``   SIGSTOP of a rank's process (the job's collective_timeout_s is short);
* ``node_loss``   SIGKILL of a worker node's raylet and every process under it (its rank actors):
                  the machine is lost for good, the job shrinks
                  (dp 4 -> 2: 3 nodes do not divide the global batch), then a node is added
                  (joining the cluster as a new machine would) and the job grows back at a checkpoint;
* ``runner_kill`` SIGKILL of the job's runner (the Ray Job's entry point);
* ``server_kill`` SIGKILL of ``raytron serve``, then the server started again on its data dir;
* ``save_crash``  a rank dies in the middle of writing a checkpoint (``serve --fault R@I:save``).

With at least as many faults as kinds, every kind is drawn. It prints one row per fault (when it
hit, the time to the next finished iteration, the iterations lost), then survived/total and the
largest relative difference between the final curve and an undisturbed run of the same spec
(on local processes). Exit status 0 when every fault was survived and the curves agree (1e-5).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from service.ranks.proc_tree import descendants, matching  # noqa: E402
from workers.rank.distributed import free_port  # noqa: E402

KINDS = ("rank_kill", "rank_stop", "node_loss", "runner_kill", "server_kill", "save_crash")
TOKEN = "chaos-token-0123456789abcdef"
MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 32}
NODES, GPUS, SAVE_EVERY = 4, 2, 2


def job_spec(iters: int) -> dict:
    return {"name": "chaos", "model": MODEL, "parallel": {"tensor_model_parallel_size": 2},
            "training": {"train_iters": iters, "global_batch_size": 8, "micro_batch_size": 1, "lr": 3e-3, "seed": 11},
            "checkpoint": {"save_interval": SAVE_EVERY, "keep_last": 3},
            "resources": {"num_nodes": NODES, "gpus_per_node": GPUS, "min_nodes": 2},
            "fault_tolerance": {"max_restarts": 50, "collective_timeout_s": 10, "node_grace_s": 3}}


def plan(seed: int, n: int, iters: int, kinds: tuple[str, ...]) -> list[dict]:
    """``n`` faults, in the order they hit: kind (each of ``kinds`` once before any repeats), the
    iteration at which it hits, and the seed of its victim."""
    rng = random.Random(seed)
    drawn: list[str] = []
    while len(drawn) < n:
        drawn += rng.sample(list(kinds), len(kinds))
    gap = max(4, (iters - 8) // max(1, n))
    out = []
    for k, kind in enumerate(drawn[:n]):
        at = 4 + k * gap + rng.randint(0, max(0, gap // 2 - 1))
        if kind == "save_crash":
            at = max(SAVE_EVERY, at // SAVE_EVERY * SAVE_EVERY)
        out.append({"kind": kind, "at": at, "victim_seed": rng.randrange(2**31)})
    return out


# ---------------------------------------------------------------------------------------------
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


def undisturbed(spec: dict) -> list[float]:
    from service.control.jobs import start_job
    from service.ranks.process_launcher import ProcessLauncher
    from service.spec.spec import parse_spec, to_job_config

    job = to_job_config(parse_spec({**spec, "checkpoint": {}}))
    result = start_job(job, launcher=ProcessLauncher(), background=False).run()
    assert result["state"] == "SUCCEEDED", result
    return result["losses"]


def run(seed: int, n: int, iters: int, kinds: tuple[str, ...], keep: bool) -> int:
    faults = plan(seed, n, iters, kinds)
    rng = random.Random(seed + 1)
    for f in faults:
        if f["kind"] == "save_crash":
            f["rank"] = rng.randrange(4)  # inside the job at any size (dp 2 holds ranks 0-3)
    drills = [f"{f['rank']}@{f['at']}:save" for f in faults if f["kind"] == "save_crash"]
    data_dir = Path(tempfile.mkdtemp(prefix="raytron-chaos-"))
    server = Server(data_dir, drills)
    spec = job_spec(iters)
    rows, survived = [], 0
    try:
        print(f"chaos: seed {seed}, {n} fault(s): {', '.join(f['kind'] + '@' + str(f['at']) for f in faults)}",
              flush=True)
        server.start()
        import httpx

        r = httpx.post(server.url + "/jobs", json=spec, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        r.raise_for_status()
        job_id = r.json()["id"]
        for f in faults:
            wait_until(server, job_id, lambda j: j["state"] == "RUNNING" and (j.get("iteration") or 0) >= f["at"]
                       - (1 if f["kind"] == "save_crash" else 0), 600, f"iteration {f['at']}")
            seq = server.get(f"/jobs/{job_id}/events")["events"][-1]["seq"]
            t0 = time.time()
            hit = inject(f, server, job_id)
            got = None
            deadline = time.monotonic() + 300
            while got is None and time.monotonic() < deadline:
                time.sleep(0.5)
                got = recovery(server, job_id, seq, t0, f["kind"])
                if server.get(f"/jobs/{job_id}")["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    got = got or recovery(server, job_id, seq, t0, f["kind"])
                    break
            if f["kind"] == "node_loss":  # the node is gone for good: a new one joins, the job grows back
                # The shrink is its resize event: near the end the job may finish its last iterations at
                # dp 2 between two polls of its sizes (seen in CI with 12 iterations left).
                job = wait_until(server, job_id, lambda j: (j.get("sizes") or {}).get("dp") == 2
                                 or shrunk_to(server, job_id, 2), 300, "the shrink")
                if job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    add_node(data_dir)
            survived += got is not None
            rows.append((f["kind"], f["at"], hit, got))
            print(f"  {f['kind']:<12} at iteration {f['at']:>3}  {hit:<26} "
                  + (f"next iteration after {got[0]:6.2f} s, {got[1]} iteration(s) lost" if got else "NOT RECOVERED"),
                  flush=True)
        job = wait_until(server, job_id, lambda j: j["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), 900, "the end")
        losses, after = [], 0  # the whole curve, page by page (GET /jobs/{id} carries only the latest loss)
        while after is not None:
            page = server.get(f"/jobs/{job_id}/metrics", names="loss", after=after, limit=10000)
            losses, after = losses + page["loss"], page["next_after"]
    finally:
        server.stop()
        from service.ranks.proc_tree import marked
        from service.ranks.ray_cluster import CLUSTER_MARK, stop_marked_cluster

        record = data_dir / "ray_cluster.json"
        if record.exists():
            data = json.loads(record.read_text())
            stop_marked_cluster(data["cluster_id"], data.get("temp_dir"), record)
        del marked, CLUSTER_MARK
        if not keep:
            subprocess.run(["rm", "-rf", str(data_dir)])
    expected = undisturbed(spec)
    diff = max((abs(a - b) / abs(b) for a, b in zip(losses, expected)), default=float("inf"))
    whole = len(losses) == len(expected)
    print(f"\n| fault | kind | at iteration | victim | to next iteration (s) | iterations lost |")
    print("|---|---|---|---|---|---|")
    for k, (kind, at, hit, got) in enumerate(rows, 1):
        print(f"| {k} | {kind} | {at} | {hit} | " + (f"{got[0]:.2f} | {got[1]} |" if got else "- | - |"))
    print(f"\nsurvived {survived}/{len(faults)}; job {job['state']} with {job['restarts']} restart(s); "
          f"{len(losses)}/{len(expected)} losses; largest relative difference from the undisturbed curve "
          f"{diff:.2e}")
    ok = survived == len(faults) and job["state"] == "SUCCEEDED" and whole and diff <= 1e-5
    print("chaos: PASSED" if ok else "chaos: FAILED", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--seed", type=int, default=1, help="seeds the kinds, iterations and victims (default 1)")
    p.add_argument("--faults", type=int, default=12, help="how many faults (default 12)")
    p.add_argument("--iters", type=int, default=None, help="the job's iterations (default 12 per fault + 16)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated kinds to draw from (default all: "
                   f"{','.join(KINDS)})")
    p.add_argument("--keep", action="store_true", help="keep the data dir (logs, store) for a look afterwards")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds or args.faults < 1:
        p.error(f"--kinds takes {', '.join(KINDS)} (got {', '.join(bad) or 'none'}); --faults at least 1")
    return run(args.seed, args.faults, args.iters or 12 * args.faults + 16, kinds, args.keep)


if __name__ == "__main__":
    sys.exit(main())
