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
(on one local process: layout invariance). Exit status 0 when every fault was survived and the curves agree (1e-5).
The server, the faults and the reading of their recovery: ``bench/chaos_faults.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.chaos_faults import GPUS, NODES, TOKEN, Server, add_node, inject, recovery, shrunk_to, wait_until

KINDS = ("rank_kill", "rank_stop", "node_loss", "runner_kill", "server_kill", "save_crash")
MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 32}
SAVE_EVERY = 2


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


def undisturbed(spec: dict) -> list[float]:
    """The spec's curve without faults, on one local process: tp 1, dp 1, the whole global batch on
    it (layout invariance: the job's own 8 ranks give the same curve, for several times the CPU)."""
    from service.control.jobs import start_job
    from service.ranks.process_launcher import ProcessLauncher
    from service.spec.spec import parse_spec, to_job_config

    job = to_job_config(parse_spec({**spec, "checkpoint": {}, "parallel": {},
                                    "resources": {"num_nodes": 1, "gpus_per_node": 1}}))
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
