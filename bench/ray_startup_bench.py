"""Start-up time on Ray: raytron's rank actors next to Ray Train's TorchTrainer (run by hand).

On one simulated cluster of 4 nodes x 2 GPU slots (started here, shared by both), it measures,
from the moment a fresh driver process is launched:

* **raytron**: ``raytron run`` of an 8-rank job (tp 2, pp 2, dp 2, a tiny model), connected to the
  cluster through ``RAY_ADDRESS``, until its first training iteration has finished;
* **Ray Train**: ``TorchTrainer.fit`` with 8 CPU workers until each worker has finished one
  all-reduce (1 MiB, gloo), the smallest useful thing a Ray Train job does.

Each system runs in its own driver process, as a user would start it, so imports count. The
systems alternate over ``--repeat`` rounds (a shared machine drifts); the table shows the
median and every run, and the ratio of medians.

    .venv/bin/python -m bench.ray_startup_bench [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.child import run_child

SPEC = """\
name: bench
model: {num_layers: 2, hidden_size: 32, num_attention_heads: 4, ffn_hidden_size: 64, vocab_size: 256, seq_length: 32}
parallel: {tensor_model_parallel_size: 2, pipeline_model_parallel_size: 2, order: tp-cp-ep-dp-pp}
training: {train_iters: 2, global_batch_size: 8, micro_batch_size: 2}
resources: {num_nodes: 4, gpus_per_node: 2}
"""


def child_raytron(spec_path: str, t_launch: float) -> dict:
    """The `raytron run` path (prepare + start_job on Ray), noting when the first iteration ends."""
    from service.control.jobs import prepare, start_job
    from service.ranks.ray_cluster import ray_session
    from service.ranks.ray_launcher import RayLauncher

    job, grid = prepare(spec_path)
    marks = {"driver_ready_s": time.time()}

    def on_event(event) -> None:
        key = {"placement": "ranks_ready_s", "iteration": "first_s"}.get(event.kind)
        if key and key not in marks:
            marks[key] = event.time

    with ray_session() as session:
        result = start_job(job, launcher=RayLauncher(session), on_event=on_event).wait()
    return {"state": result["state"], **{k: v - t_launch for k, v in marks.items()},
            "total_s": time.time() - t_launch}


def _ray_train_fn(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import ray.train

    t = torch.ones(256 * 1024)  # 1 MiB of float32
    dist.all_reduce(t)
    # Ray Train v2 keeps reported metrics only alongside checkpoints: note the time in a file.
    with open(os.path.join(config["out"], f"rank{ray.train.get_context().get_world_rank()}"), "w") as f:
        f.write(repr(time.time()))


def child_ray_train(t_launch: float, workers: int) -> dict:
    """TorchTrainer with ``workers`` CPU workers doing one all-reduce each."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="warning")
    storage = tempfile.mkdtemp(prefix="raytron-bench-train-")
    out = os.path.join(storage, "done")
    os.makedirs(out)
    trainer = TorchTrainer(_ray_train_fn, train_loop_config={"out": out},
                           scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                           run_config=RunConfig(storage_path=storage, name="bench"))
    result = trainer.fit()
    ray.shutdown()
    done = [float(open(os.path.join(out, name)).read()) for name in os.listdir(out)]
    shutil.rmtree(storage, ignore_errors=True)
    ok = result.error is None and len(done) == workers
    return {"state": "SUCCEEDED" if ok else "FAILED", "first_s": max(done) - t_launch if done else None,
            "total_s": time.time() - t_launch}


def _launch(args: list[str], env: dict) -> dict:
    return run_child("bench.ray_startup_bench", [*args, "--t-launch", repr(time.time())], env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="rounds (each runs both systems once)")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="raytron job with use_distributed_optimizer (no torch.optim, so no torch._dynamo import)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--t-launch", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind = args.child[0]
        out = child_raytron(args.child[1], args.t_launch) if kind == "raytron" else \
            child_ray_train(args.t_launch, int(args.child[1]))
        print(json.dumps(out))
        return

    from service.ranks.ray_cluster import simulated_cluster

    runs: dict[str, list[dict]] = {"raytron": [], "ray_train": []}
    with tempfile.TemporaryDirectory(prefix="raytron-bench-") as tmp:
        spec = os.path.join(tmp, "bench.yaml")
        with open(spec, "w") as f:
            f.write(SPEC.replace("order: tp-cp-ep-dp-pp", "order: tp-cp-ep-dp-pp, use_distributed_optimizer: true")
                    if args.distributed_optimizer else SPEC)
        t0 = time.time()
        with simulated_cluster(4, 2) as session:
            print(f"simulated cluster 4 nodes x 2 GPU slots up in {time.time() - t0:.1f}s "
                  f"({session.address}); {os.cpu_count()} CPU cores", file=sys.stderr)
            # The children connect through RAY_ADDRESS and inherit the loopback/no-auth settings.
            env = {**os.environ, "RAY_ADDRESS": session.address}
            for i in range(args.repeat):
                for name, child in (("raytron", ["raytron", spec]), ("ray_train", ["ray_train", "8"])):
                    time.sleep(3)  # let the previous job's processes exit
                    runs[name].append(_launch(child, env))
                    r = runs[name][-1]
                    print(f"round {i + 1} {name}: " + " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                                for k, v in r.items()), file=sys.stderr)

    med = {k: statistics.median(r["first_s"] for r in v) for k, v in runs.items()}
    print(f"\n{'8 ranks, simulated 4x2 cluster':<34}{'median s':>10}   runs (s, launch -> first step done)")
    for name, label in (("raytron", "raytron run -> 1st iteration"), ("ray_train", "Ray Train fit -> 1st all-reduce")):
        print(f"{label:<34}{med[name]:>10.1f}   " + " ".join(f"{r['first_s']:.1f}" for r in runs[name]))
    print(f"{'ratio raytron / Ray Train':<34}{med['raytron'] / med['ray_train']:>10.2f}   (target <= 0.50)")


if __name__ == "__main__":
    main()
