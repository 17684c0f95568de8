"""Recovery time after a rank is killed: raytron next to Ray Train's FailureConfig (run by hand).

On one simulated cluster of 5 nodes x 2 GPU slots (started here, shared by every path; the jobs
use 4 nodes, the spare path 5), each path in a driver process of its own connected through
``RAY_ADDRESS``:

* **raytron** (``bench/recovery_kills.py``): the 40-iteration job (8 ranks, tp 2 x dp 4, a small
  model, a disk checkpoint every 20 iterations), rank 3 killed with SIGKILL five times
  (``RAYTRON_BENCH_KILLS``), in three modes: *spare* (``fault_tolerance.memory_interval: 1`` and
  ``resources.spare_nodes: 1``), *memory* (memory_interval 1, no spare) and *disk* (neither).
  Each job's losses against the same job run undisturbed (no kill) first, on the same cluster.
  The median over the kills of the time from the kill to the next finished iteration, split into
  detection (with its profile), replacement, restore and first iteration; iterations lost; then
  each kind of rank's timeline (kept in place, a spare taking a rank: wall and CPU seconds of each
  step from its reset to its restore, ``workers/rank/timeline.py``) and the driver's marks.
* **replication's cost**: undisturbed 30-iteration runs without and with memory_interval 1, three
  times, interleaved (without, with, without, ...): per pair the ranks' time per iteration and the
  wall time per iteration, then the median of the pairs' ratios, bytes sent and host memory per rank.
* **Ray Train**: ``TorchTrainer`` with 8 CPU workers and ``FailureConfig(max_failures=5)``; each
  step is a 1 MiB all-reduce; worker 3 is killed with SIGKILL after its third step, five times.
  Measured: kill -> every restarted worker has finished its first all-reduce (the median).

    .venv/bin/python -m bench.recovery_bench              # every path, ~8 minutes on 2 cores
    .venv/bin/python -m bench.recovery_bench --only spare # the spare path alone
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from bench.child import run_child
from bench.recovery_kills import child_kills, median_split, rank_profile

SPEC = {"name": "recovery", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                      "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 32},
        "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": 6, "global_batch_size": 8, "micro_batch_size": 1},
        "resources": {"num_nodes": 4, "gpus_per_node": 2},
        "fault_tolerance": {"max_restarts": 1, "collective_timeout_s": 60}}


PAIRS = 3  # without/with replication pairs of undisturbed jobs, interleaved


def memory_spec(ckpt_dir: str, interval: int) -> dict:
    """The job with a snapshot in memory every ``interval`` iterations (0: none) and no disk save in its run."""
    return {**SPEC, "checkpoint": {"save_interval": 1000, "dir": ckpt_dir},
            "fault_tolerance": {**SPEC["fault_tolerance"], "memory_interval": interval}}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def child_steps(ckpt_dir: str, interval: int) -> dict:
    """An undisturbed run of 30 iterations with a snapshot every ``interval`` iterations (0: none): the
    ranks' time per iteration (train step plus the snapshot's own time) and the wall time per iteration."""
    from service.control.jobs import start_job
    from service.ranks.ray_cluster import ray_session
    from service.ranks.ray_launcher import RayLauncher
    from service.spec.spec import parse_spec, to_job_config

    spec = memory_spec(ckpt_dir, interval)
    spec = {**spec, "training": {**spec["training"], "train_iters": 30}}
    times: list = []
    with ray_session() as session:
        start_job(to_job_config(parse_spec(spec)), launcher=RayLauncher(session),
                  on_event=lambda e: times.append((e.time, e.data)) if e.kind == "iteration" else None).wait()
    steady = times[5:]
    return {"rank_step_s": _median([d["step_time_s"] + d.get("memory_snapshot_s", 0.0) for _, d in steady]),
            "wall_per_iteration_s": (steady[-1][0] - steady[0][0]) / (len(steady) - 1),
            "bytes_sent_per_rank": steady[-1][1].get("memory_bytes_sent"),
            "host_bytes_per_rank": steady[-1][1].get("memory_host_bytes")}


def _ray_train_fn(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import ray.train

    rank = ray.train.get_context().get_world_rank()
    out = config["out"]
    attempt = sum(1 for n in os.listdir(out) if n.startswith("killed"))  # restarts so far
    for step in range(1, 7):
        dist.all_reduce(torch.ones(256 * 1024))
        if attempt and step == 1:
            with open(os.path.join(out, f"first{attempt}-{rank}"), "w") as f:
                f.write(repr(time.time()))
        if rank == 3:
            with open(os.path.join(out, "rank3"), "w") as f:
                f.write(f"{os.getpid()} {step} {attempt}")
        time.sleep(0.3)


def child_ray_train(workers: int, kills: int) -> dict:
    """``TorchTrainer`` with ``FailureConfig(max_failures=kills)``; worker 3 killed after its third
    step of each attempt, ``kills`` times: kill -> every restarted worker's first all-reduce done."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="warning")
    storage = tempfile.mkdtemp(prefix="raytron-bench-train-")
    out = os.path.join(storage, "marks")
    os.makedirs(out)

    def killer() -> None:
        path = os.path.join(out, "rank3")
        for i in range(kills):
            while True:
                try:
                    pid, step, attempt = map(int, open(path).read().split())
                    if attempt == i and step >= 3:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.01)
            with open(os.path.join(out, f"killed{i}"), "w") as f:
                f.write(repr(time.time()))
            os.kill(pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    trainer = TorchTrainer(_ray_train_fn, train_loop_config={"out": out},
                           scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                           run_config=RunConfig(storage_path=storage, name="bench",
                                                failure_config=FailureConfig(max_failures=kills)))
    result = trainer.fit()
    ray.shutdown()
    totals = []
    for i in range(kills):
        killed = float(open(os.path.join(out, f"killed{i}")).read())
        firsts = [float(open(os.path.join(out, n)).read()) for n in os.listdir(out) if n.startswith(f"first{i + 1}-")]
        totals.append(max(firsts) - killed if len(firsts) == workers else None)
    shutil.rmtree(storage, ignore_errors=True)
    ok = result.error is None and None not in totals
    return {"state": "SUCCEEDED" if ok else "FAILED", "totals": totals,
            "total_s": _median([t for t in totals if t is not None]) if ok else None}


SPLIT = ("detection_s", "  death known to the driver", "  survivors reset", "  dead actors gone", "replacement_s",
         "restore_s", "first_iteration_s", "total_s")
PROFILE = {"  death known to the driver": "death_known", "  survivors reset": "survivors_reset",
           "  dead actors gone": "dead_gone"}


def _curve(run: dict, reference: dict) -> str:
    """How the killed job's losses compare with the undisturbed job's (the same spec, no kill)."""
    got, want = run.get("losses") or [], reference.get("losses") or []
    if len(got) != len(want):
        return f"{len(got)} losses against the undisturbed run's {len(want)}"
    worst = max((abs(a - b) / abs(b) for a, b in zip(got, want)), default=0.0)
    return f"losses within {worst:.1e} of the undisturbed run's ({'equal at 1e-6' if worst <= 1e-6 else 'NOT within 1e-6'})"


def _launch(args: list[str], env: dict) -> dict:
    return run_child("bench.recovery_bench", args, env)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, arg = sys.argv[2], sys.argv[3]
        kills = int(os.environ.get("RAYTRON_BENCH_KILLS", "5"))
        if kind == "ray_train":
            out = child_ray_train(int(arg), kills)
        elif kind == "steps":
            out = child_steps(tempfile.mkdtemp(prefix="raytron-bench-steps-"), int(arg))
        else:
            out = child_kills(SPEC, kind, arg, kills=kills)
        print(json.dumps(out))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.recovery_bench", description=__doc__.split("\n\n")[0],
                                     epilog="Prints the medians side by side, then the ratios and replication's cost.")
    parser.add_argument("--only", choices=["spare"], default=os.environ.get("RAYTRON_BENCH_ONLY") or None,
                        help="run the spare path alone (no memory/disk paths, no Ray Train, no step times)")
    parser.add_argument("--kills", type=int, default=int(os.environ.get("RAYTRON_BENCH_KILLS", "5")),
                        help="kills per job (default 5; the medians are over these)")
    args = parser.parse_args()
    if args.kills < 1:
        parser.error(f"--kills {args.kills}: needs at least 1 kill")
    from service.ranks.ray_cluster import simulated_cluster

    only = args.only or ""
    paths = ["spare"] if only == "spare" else ["spare", "memory", "disk"]
    with tempfile.TemporaryDirectory(prefix="raytron-bench-") as tmp, simulated_cluster(5, 2) as session:
        env = {**os.environ, "RAYTRON_BENCH_KILLS": str(args.kills), "RAY_ADDRESS": session.address}
        reference = _launch(["disk", os.path.join(tmp, "undisturbed")], {**env, "RAYTRON_BENCH_KILLS": "0"})
        runs = {}
        for mode in paths:
            runs[mode] = _launch([mode, os.path.join(tmp, mode)], env)
            print(f"raytron {mode}:", json.dumps(runs[mode]), file=sys.stderr)
        steps = None
        if not only:
            # without / with, twice, interleaved: the machine's drift between two jobs is of the
            # size of the cost measured, so each pair is compared back to back and both are shown
            steps = [_launch(["steps", str(interval)], env) for interval in (0, 1) * PAIRS]
            print("steps:", json.dumps(steps), file=sys.stderr)
            time.sleep(3)
            theirs = _launch(["ray_train", "8"], env)
            print("ray_train:", json.dumps(theirs), file=sys.stderr)
    med = {mode: median_split(run["kills"]) for mode, run in runs.items()}
    header = f"kill -9 of rank 3 -> next iteration done, median of {len(med['spare']['totals'])} kills"
    print(f"\n{header:<50}" + "".join(f"{m:>9}" for m in med) + ("" if only else f"{'Ray Train':>11}"))
    for key in SPLIT:
        name = PROFILE.get(key, key)
        row = f"  {key:<48}" + "".join(f"{m[name]:>9.2f}" for m in med.values())
        print(row + (f"{theirs['total_s']:>11.2f}" if key == "total_s" and not only else ""))
    for mode, m in med.items():
        print(f"  {mode}: each kill's total {m['totals']} s; (killed after, restored) {m['restored']}; "
              f"iterations lost {m['iterations_lost']}; a spare took the ranks in {m['spare_taken']}; "
              f"job {runs[mode]['state']}, restarts {runs[mode]['restarts']}; {_curve(runs[mode], reference)}")
        print("\n".join(rank_profile(runs[mode]["kills"])))
    if only:
        return
    sp, disk = med["spare"]["total_s"], med["disk"]["total_s"]
    print(f"  Ray Train: each kill's total {[round(t, 3) for t in theirs['totals']]} s, {theirs['state']}")
    print(f"  {'ratio spare / disk (target < 0.3)':<48}{sp / disk:>9.2f}")
    print(f"  {'ratio spare / Ray Train (target < 0.1)':<48}{sp / theirs['total_s']:>9.2f}")
    print(f"  {'ratio memory / disk':<48}{med['memory']['total_s'] / disk:>9.2f}")
    ratios = []
    for pair, (plain, replicated) in enumerate(zip(steps[::2], steps[1::2]), 1):
        ratio = replicated["rank_step_s"] / plain["rank_step_s"]
        ratios.append(ratio)
        print(f"step time without / with replication, pair {pair}: rank {plain['rank_step_s'] * 1000:.1f} / "
              f"{replicated['rank_step_s'] * 1000:.1f} ms ({ratio:.2f}x), wall per iteration "
              f"{plain['wall_per_iteration_s'] * 1000:.1f} / {replicated['wall_per_iteration_s'] * 1000:.1f} ms "
              f"({replicated['wall_per_iteration_s'] / plain['wall_per_iteration_s']:.2f}x)")
    print(f"replication's cost: {_median(ratios):.2f}x the ranks' time per iteration, the median of the {PAIRS} "
          f"pairs (target <= 1.10x); {steps[1]['bytes_sent_per_rank']} bytes sent per rank per iteration, "
          f"{steps[1]['host_bytes_per_rank']} bytes of host memory per rank")


if __name__ == "__main__":
    main()
