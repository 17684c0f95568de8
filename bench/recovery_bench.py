"""Recovery time after a rank is killed: raytron next to Ray Train's FailureConfig (run by hand).

On one simulated cluster of 5 nodes x 2 GPU slots (the jobs use 4, the spare path 5) (started here, shared by both), 8 ranks each:

* **raytron**: an 8-rank job (tp 2, dp 4, a small model, a checkpoint every iteration) through
  ``start_job`` on Ray; when iteration 3 ends, rank 3's process is killed with SIGKILL. Split
  from the job's own events: *detection + teardown* (kill -> failure event: the controller stops
  every actor and removes the placement group before it records the failure), *replan* (failure
  -> the new attempt's STARTING: policy, sizing, choosing the checkpoint), *restart* (STARTING ->
  ranks placed, minus the checkpoint load), *restore* (the slowest rank's checkpoint load) and
  *first iteration* (placed -> the next iteration finished). Also the checkpoint's save seconds
  (rank 0, per save) and bytes per rank (its data file), and how many ranks the new attempt
  started again in place (the survivors: see ``service/ranks/ray_launcher.py``).
* **raytron, in memory**: the same job with ``fault_tolerance.memory_interval: 1`` (a snapshot of every
  rank's state in host memory after every iteration, replicated to a rank on another node) and no
  disk checkpoint in its run, the same kill and the same split (*restore*: the slowest rank's agreement
  and restore from memory); iterations lost (recorded before the kill, minus the iteration restored);
  the snapshot's time and bytes sent per rank per iteration, its host memory per rank; and, from two
  undisturbed 30-iteration runs, the time per iteration without and with replication (the ranks'
  train step plus snapshot, and the wall time per iteration the driver sees).
* **raytron, in memory with a hot spare**: the same job with ``resources.spare_nodes: 1`` as well, rank 3
  killed five times (``bench/recovery_spare.py``); the median of each figure over the kills.
* **Ray Train**: ``TorchTrainer`` with 8 CPU workers and ``FailureConfig(max_failures=1)``; each
  step is a 1 MiB all-reduce; worker 3 is killed with SIGKILL after its third step. Measured:
  kill -> every restarted worker has finished its first all-reduce.

Each system runs in its own driver process connected through ``RAY_ADDRESS``.

    .venv/bin/python -m bench.recovery_bench
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

from bench.child import run_child
from bench.recovery_spare import median_split

SPEC = {"name": "recovery", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                      "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 32},
        "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": 6, "global_batch_size": 8, "micro_batch_size": 1},
        "resources": {"num_nodes": 4, "gpus_per_node": 2},
        "fault_tolerance": {"max_restarts": 1, "collective_timeout_s": 60}}


def memory_spec(ckpt_dir: str, interval: int) -> dict:
    """The job with a snapshot in memory every ``interval`` iterations (0: none) and no disk save in its run."""
    return {**SPEC, "checkpoint": {"save_interval": 1000, "dir": ckpt_dir},
            "fault_tolerance": {**SPEC["fault_tolerance"], "memory_interval": interval}}


def child_raytron(ckpt_dir: str, mode: str = "disk") -> dict:
    from service.control.events import JobState
    from service.control.jobs import start_job
    from service.ranks.ray_cluster import ray_session
    from service.ranks.ray_launcher import RayLauncher
    from service.spec.spec import parse_spec, to_job_config

    spec = memory_spec(ckpt_dir, 1) if mode == "memory" else {**SPEC, "checkpoint": {"save_interval": 1, "dir": ckpt_dir}}
    job = to_job_config(parse_spec(spec))
    marks: dict = {}
    placements: list = []
    saves: list = []
    recorded: list = []
    memory: list = []

    def on_event(e) -> None:
        if e.kind == "placement":
            placements.append((e.time, e.data["placement"]))
        elif e.kind == "iteration":
            saves.append(e.data.get("checkpoint_save_s"))
            memory.append(e.data)
            if "failure" not in marks:
                recorded.append(e.data["iteration"])
            if e.data["iteration"] == 3 and "kill" not in marks:
                rank3 = next(p for p in placements[-1][1] if p["rank"] == 3)
                marks["kill"] = time.time()
                os.kill(rank3["pid"], signal.SIGKILL)
            elif "kill" in marks and "failure" in marks and "next_iteration" not in marks:
                marks["next_iteration"] = e.time
        elif e.kind == "failure" and "failure" not in marks:
            marks["failure"] = e.time
        elif e.kind == "state" and e.state is JobState.STARTING and "failure" in marks and "starting" not in marks:
            marks["starting"] = e.time

    with ray_session() as session:
        result = start_job(job, launcher=RayLauncher(session), on_event=on_event).wait()
    placed_t, placed = placements[-1]
    load = max(p.get("load_s") or 0.0 for p in placed)
    resumed = int(placed[0].get("resumed_iteration") or 0)
    figures = {"iterations_lost": max(recorded) - resumed, "resumed_iteration": resumed,
               "resumed_from": placed[0].get("resumed_from"), "reused_ranks": [p["rank"] for p in placed if p.get("reused")]}
    if mode == "memory":
        snap = [m for m in memory if "memory_bytes_sent" in m]
        return {"state": result["state"], "restarts": result["restarts"], **figures,
                "detect_and_teardown_s": marks["failure"] - marks["kill"], "replan_s": marks["starting"] - marks["failure"],
                "restart_s": placed_t - marks["starting"] - load, "restore_s": load,
                "first_iteration_s": marks["next_iteration"] - placed_t, "total_s": marks["next_iteration"] - marks["kill"],
                "snapshot_s_median": _median([m["memory_snapshot_s"] for m in snap]),
                "bytes_sent_per_rank": snap[-1]["memory_bytes_sent"], "host_bytes_per_rank": snap[-1]["memory_host_bytes"]}
    sizes = {name: os.path.getsize(os.path.join(ckpt_dir, d, name))
             for d in sorted(os.listdir(ckpt_dir)) if d.startswith("iter_")
             for name in os.listdir(os.path.join(ckpt_dir, d)) if name.endswith(".bin")}
    return {"state": result["state"], "restarts": result["restarts"],
            "detect_and_teardown_s": marks["failure"] - marks["kill"], "replan_s": marks["starting"] - marks["failure"],
            "restart_s": placed_t - marks["starting"] - load, "restore_s": load,
            "first_iteration_s": marks["next_iteration"] - placed_t, "total_s": marks["next_iteration"] - marks["kill"],
            "save_s_median": sorted(s for s in saves if s)[len([s for s in saves if s]) // 2],
            "load_s_max": load, "bytes_per_rank": sorted(sizes.values()), **figures}


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
            "wall_per_iteration_s": (steady[-1][0] - steady[0][0]) / (len(steady) - 1)}


def _ray_train_fn(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import ray.train

    rank = ray.train.get_context().get_world_rank()
    out = config["out"]
    restarted = os.path.exists(os.path.join(out, "killed"))
    for step in range(1, 7):
        dist.all_reduce(torch.ones(256 * 1024))
        if restarted and step == 1:
            with open(os.path.join(out, f"first{rank}"), "w") as f:
                f.write(repr(time.time()))
        if rank == 3 and not restarted:
            with open(os.path.join(out, "rank3"), "w") as f:
                f.write(f"{os.getpid()} {step}")
        time.sleep(0.3)


def child_ray_train(workers: int) -> dict:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="warning")
    storage = tempfile.mkdtemp(prefix="raytron-bench-train-")
    out = os.path.join(storage, "marks")
    os.makedirs(out)

    def killer() -> None:
        path = os.path.join(out, "rank3")
        while True:
            try:
                pid, step = map(int, open(path).read().split())
                if step >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        with open(os.path.join(out, "killed"), "w") as f:
            f.write(repr(time.time()))
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    trainer = TorchTrainer(_ray_train_fn, train_loop_config={"out": out},
                           scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                           run_config=RunConfig(storage_path=storage, name="bench",
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    ray.shutdown()
    killed = float(open(os.path.join(out, "killed")).read())
    firsts = [float(open(os.path.join(out, n)).read()) for n in os.listdir(out) if n.startswith("first")]
    shutil.rmtree(storage, ignore_errors=True)
    ok = result.error is None and len(firsts) == workers
    return {"state": "SUCCEEDED" if ok else "FAILED", "total_s": max(firsts) - killed if firsts else None}


def _print_spare(sp: dict) -> None:
    print(f"memory+spare (one spare node), median over {len(sp['totals'])} kills: "
          + ", ".join(f"{k} {sp[k]:.2f}" for k in ("detection_s", "replacement_s", "restore_s", "first_iteration_s",
                                                    "total_s")))
    print(f"  each kill's total {sp['totals']} s; iterations lost {sp['iterations_lost']}; "
          f"a spare took the ranks in {sp['spare_taken']} of them")


def _launch(args: list[str], env: dict) -> dict:
    return run_child("bench.recovery_bench", args, env)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, arg = sys.argv[2], sys.argv[3]
        if kind == "ray_train":
            out = child_ray_train(int(arg))
        elif kind == "spare":
            from bench.recovery_spare import child_spare

            out = child_spare(SPEC, kills=int(arg))
        elif kind == "steps":
            out = child_steps(tempfile.mkdtemp(prefix="raytron-bench-steps-"), int(arg))
        else:
            out = child_raytron(arg, "memory" if kind == "memory" else "disk")
        print(json.dumps(out))
        return
    from service.ranks.ray_cluster import simulated_cluster

    with tempfile.TemporaryDirectory(prefix="raytron-bench-") as tmp, simulated_cluster(5, 2) as session:
        env = {**os.environ, "RAY_ADDRESS": session.address}
        spare = _launch(["spare", os.environ.get("RAYTRON_BENCH_KILLS", "5")], env)
        print("raytron memory+spare:", json.dumps(spare), file=sys.stderr)
        if os.environ.get("RAYTRON_BENCH_ONLY") == "spare":
            _print_spare(median_split(spare["kills"]))
            return
        mem = _launch(["memory", os.path.join(tmp, "mem")], env)
        print("raytron memory:", json.dumps(mem), file=sys.stderr)
        ours = _launch(["raytron", os.path.join(tmp, "ckpt")], env)
        print("raytron disk:", json.dumps(ours), file=sys.stderr)
        plain, replicated = _launch(["steps", "0"], env), _launch(["steps", "1"], env)
        print("steps:", json.dumps([plain, replicated]), file=sys.stderr)
        time.sleep(3)
        theirs = _launch(["ray_train", "8"], env)
        print("ray_train:", json.dumps(theirs), file=sys.stderr)
    sp = median_split(spare["kills"])
    print(f"\n{'kill -9 of rank 3 -> next step done, 8 ranks on 4x2':<46}{'memory':>9}{'disk':>9}{'Ray Train':>11}")
    for key in ("detect_and_teardown_s", "replan_s", "restart_s", "restore_s", "first_iteration_s"):
        print(f"  {key:<44}{mem[key]:>9.2f}{ours[key]:>9.2f}{'':>11}")
    print(f"  {'total':<44}{mem['total_s']:>9.2f}{ours['total_s']:>9.2f}{theirs['total_s']:>11.2f}")
    _print_spare(sp)
    print(f"  {'ratio memory+spare / disk (target < 0.3)':<44}{sp['total_s'] / ours['total_s']:>9.2f}")
    print(f"  {'ratio memory+spare / Ray Train (target < 0.1)':<44}{sp['total_s'] / theirs['total_s']:>9.2f}")
    print(f"  {'iterations lost':<44}{mem['iterations_lost']:>9}{ours['iterations_lost']:>9}")
    print(f"  {'ratio memory / disk (target < 0.3)':<44}{mem['total_s'] / ours['total_s']:>9.2f}")
    print(f"  {'ratio memory / Ray Train (target < 0.1)':<44}{mem['total_s'] / theirs['total_s']:>9.2f}")
    print(f"  {'ratio disk / Ray Train':<44}{ours['total_s'] / theirs['total_s']:>9.2f}")
    print(f"restarted in place: ranks {ours['reused_ranks']} (disk), {mem['reused_ranks']} (memory); "
          f"restored from {mem['resumed_from']} at iteration {mem['resumed_iteration']}")
    print(f"checkpoint: save {ours['save_s_median']:.3f}s (rank 0, median), load {ours['load_s_max']:.3f}s "
          f"(slowest rank), bytes per rank {ours['bytes_per_rank']}")
    print(f"replication every iteration: snapshot {mem['snapshot_s_median'] * 1000:.1f} ms (rank 0, median), "
          f"{mem['bytes_sent_per_rank']} bytes sent per rank per iteration, {mem['host_bytes_per_rank']} bytes "
          f"of host memory per rank")
    print(f"step time without / with replication: rank {plain['rank_step_s'] * 1000:.1f} / "
          f"{replicated['rank_step_s'] * 1000:.1f} ms ({replicated['rank_step_s'] / plain['rank_step_s']:.2f}x, target "
          f"<= 1.10x), wall per iteration {plain['wall_per_iteration_s'] * 1000:.1f} / "
          f"{replicated['wall_per_iteration_s'] * 1000:.1f} ms "
          f"({replicated['wall_per_iteration_s'] / plain['wall_per_iteration_s']:.2f}x)")


if __name__ == "__main__":
    main()
