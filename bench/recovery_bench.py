"""Recovery time after a rank is killed: raytron next to Ray Train's FailureConfig (run by hand).

On one simulated cluster of 4 nodes x 2 GPU slots (started here, shared by both), 8 ranks each:

* **raytron**: an 8-rank job (tp 2, dp 4, a small model, a checkpoint every iteration) through
  ``start_job`` on Ray; when iteration 3 ends, rank 3's process is killed with SIGKILL. Split
  from the job's own events: *detection + teardown* (kill -> failure event: the controller stops
  every actor and removes the placement group before it records the failure), *replan* (failure
  -> the new attempt's STARTING: policy, sizing, choosing the checkpoint), *restart* (STARTING ->
  ranks placed, minus the checkpoint load), *restore* (the slowest rank's checkpoint load) and
  *first iteration* (placed -> the next iteration finished). Also the checkpoint's save seconds
  (rank 0, per save) and bytes per rank (its data file), and how many ranks the new attempt
  started again in place (the survivors: see ``service/ranks/ray_launcher.py``).
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

SPEC = {"name": "recovery", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                      "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 32},
        "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": 6, "global_batch_size": 8, "micro_batch_size": 1},
        "resources": {"num_nodes": 4, "gpus_per_node": 2},
        "fault_tolerance": {"max_restarts": 1, "collective_timeout_s": 60}}


def child_raytron(ckpt_dir: str) -> dict:
    from service.control.events import JobState
    from service.control.jobs import start_job
    from service.ranks.ray_cluster import ray_session
    from service.ranks.ray_launcher import RayLauncher
    from service.spec.spec import parse_spec, to_job_config

    job = to_job_config(parse_spec({**SPEC, "checkpoint": {"save_interval": 1, "dir": ckpt_dir}}))
    marks: dict = {}
    placements: list = []
    saves: list = []

    def on_event(e) -> None:
        if e.kind == "placement":
            placements.append((e.time, e.data["placement"]))
        elif e.kind == "iteration":
            saves.append(e.data.get("checkpoint_save_s"))
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
    sizes = {name: os.path.getsize(os.path.join(ckpt_dir, d, name))
             for d in sorted(os.listdir(ckpt_dir)) if d.startswith("iter_")
             for name in os.listdir(os.path.join(ckpt_dir, d)) if name.endswith(".bin")}
    return {"state": result["state"], "restarts": result["restarts"],
            "detect_and_teardown_s": marks["failure"] - marks["kill"], "replan_s": marks["starting"] - marks["failure"],
            "restart_s": placed_t - marks["starting"] - load, "restore_s": load,
            "first_iteration_s": marks["next_iteration"] - placed_t, "total_s": marks["next_iteration"] - marks["kill"],
            "save_s_median": sorted(s for s in saves if s)[len([s for s in saves if s]) // 2],
            "load_s_max": load, "bytes_per_rank": sorted(sizes.values()),
            "reused_ranks": [p["rank"] for p in placed if p.get("reused")]}


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


def _launch(args: list[str], env: dict) -> dict:
    return run_child("bench.recovery_bench", args, env)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        out = child_raytron(sys.argv[3]) if sys.argv[2] == "raytron" else child_ray_train(int(sys.argv[3]))
        print(json.dumps(out))
        return
    from service.ranks.ray_cluster import simulated_cluster

    with tempfile.TemporaryDirectory(prefix="raytron-bench-") as tmp, simulated_cluster(4, 2) as session:
        env = {**os.environ, "RAY_ADDRESS": session.address}
        ours = _launch(["raytron", os.path.join(tmp, "ckpt")], env)
        print("raytron:", json.dumps(ours), file=sys.stderr)
        time.sleep(3)
        theirs = _launch(["ray_train", "8"], env)
        print("ray_train:", json.dumps(theirs), file=sys.stderr)
    print(f"\n{'kill -9 of rank 3 -> next step done, 8 ranks on 4x2':<52}{'raytron':>10}{'Ray Train':>11}")
    for key in ("detect_and_teardown_s", "replan_s", "restart_s", "restore_s", "first_iteration_s"):
        print(f"  {key:<50}{ours[key]:>10.2f}{'':>11}")
    print(f"  {'total':<50}{ours['total_s']:>10.2f}{theirs['total_s']:>11.2f}")
    print(f"  {'ratio raytron / Ray Train (target <= 0.50)':<50}{ours['total_s'] / theirs['total_s']:>10.2f}")
    print(f"restarted in place: ranks {ours['reused_ranks']} ({len(ours['reused_ranks'])} of 8; the others new actors)")
    print(f"checkpoint: save {ours['save_s_median']:.3f}s (rank 0, median), load {ours['load_s_max']:.3f}s "
          f"(slowest rank), bytes per rank {ours['bytes_per_rank']}")


if __name__ == "__main__":
    main()
