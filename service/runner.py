"""`raytron run`: validate, plan, launch (local processes or Ray), and print the result."""

from __future__ import annotations

import json
import sys
import time
import uuid

from service.placement import plan_placement
from service.spec import load_spec, to_job_config
from workers.config import JobConfig
from workers.grid import ParallelGrid


def prepare(spec_path: str) -> tuple[JobConfig, ParallelGrid, list]:
    """Everything that can be refused before a process starts. Raises ValueError."""
    from workers.dataset import check_corpus

    job = to_job_config(load_spec(spec_path))
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    plan = plan_placement(grid, job.gpus_per_node, job.num_nodes)
    check_corpus(job.training.data, job.model.vocab_size, job.model.seq_length)
    return job, grid, plan


def new_job_id(job: JobConfig) -> str:
    return f"{job.name}-{uuid.uuid4().hex[:8]}"


def result_object(job_id: str, state: str, grid: ParallelGrid, losses: list[float], placement: list[dict],
                  restarts: int = 0) -> dict:
    """The final object of contract 3."""
    return {"job_id": job_id, "state": state, "iterations": len(losses), "losses": losses, "restarts": restarts,
            "world_size": grid.world_size, "sizes": grid.sizes(),
            "placement": [{k: p[k] for k in ("rank", "node_id", "pid", "tp", "pp", "dp", "cp", "ep")} for p in placement]}


def print_plan(grid: ParallelGrid, plan, out=sys.stderr) -> None:
    print(f"placement plan: world_size {grid.world_size}, " + " ".join(f"{k}={v}" for k, v in grid.sizes().items()),
          file=out)
    print(f"{'rank':>6}{'node':>6}{'slot':>6}{'tp':>4}{'cp':>4}{'dp':>4}{'pp':>4}{'ep':>4}", file=out)
    for p in plan:
        c = grid.coords(p.rank)
        print(f"{p.rank:>6}{p.node:>6}{p.local:>6}{c['tp']:>4}{c['cp']:>4}{c['dp']:>4}{c['pp']:>4}{c['ep']:>4}", file=out)


def print_placement(placement: list[dict], out=sys.stderr) -> None:
    print(f"{'rank':>6}  {'node_id':<20}{'pid':>8}{'tp':>4}{'cp':>4}{'dp':>4}{'pp':>4}{'ep':>4}", file=out)
    for p in placement:
        print(f"{p['rank']:>6}  {str(p['node_id'])[:18]:<20}{p['pid']:>8}{p['tp']:>4}{p['cp']:>4}{p['dp']:>4}"
              f"{p['pp']:>4}{p['ep']:>4}", file=out)


class Progress:
    """A tqdm bar over iterations (stderr), silent when ``enabled`` is False."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="it", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, rank: int, event: dict) -> None:
        if self.bar is not None and event.get("event") == "iteration":
            self.bar.set_postfix(loss=f"{event['loss']:.4f}", tok_s=f"{event['tokens_per_s']:.0f}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_processes(job: JobConfig, grid: ParallelGrid, *, progress: bool = False, job_id: str | None = None) -> dict:
    """Run every rank as a local process (gloo on a free port); returns the result object."""
    from workers.rank_main import train_rank
    from workers.spawn import run_ranks

    job_id = job_id or new_job_id(job)
    bar = Progress(job.training.train_iters, progress, job.name)
    try:
        records = run_ranks(train_rank, grid.world_size, args=(job,), on_event=bar,
                            timeout_s=24 * 3600, collective_timeout_s=300)
    finally:
        bar.close()
    return result_object(job_id, "SUCCEEDED", grid, records[0]["losses"], records)


def run_torchrun_rank(job: JobConfig, grid: ParallelGrid, env: dict) -> dict | None:
    """One rank of a torchrun launch; the result object is returned on rank 0 only."""
    import torch.distributed as dist

    from workers.rank_main import train_rank
    from workers.spawn import init_distributed

    if env["world_size"] != grid.world_size:
        raise ValueError(f"torchrun started {env['world_size']} processes but the spec's world_size is "
                         f"{grid.world_size} (resources.num_nodes x gpus_per_node)")
    init_distributed(env["rank"], env["world_size"], env["master_addr"], env["master_port"])
    record = train_rank(env["rank"], env["world_size"], job, local_rank=env["local_rank"])
    records = [None] * env["world_size"]
    dist.all_gather_object(records, record)
    dist.destroy_process_group()
    return result_object(new_job_id(job), "SUCCEEDED", grid, records[0]["losses"], records) if env["rank"] == 0 else None


def run_from_cli(args) -> int:
    from api.cli import UsageError
    from workers.rank_main import torchrun_env

    try:
        job, grid, plan = prepare(args.spec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    t0 = time.time()
    env = torchrun_env() if args.launcher == "processes" else None
    if env is not None:
        result = run_torchrun_rank(job, grid, env)
        if result is None:
            return 0
    else:
        if not args.json:
            print_plan(grid, plan)  # the plan is shown before anything launches
        if args.launcher == "processes":
            result = run_processes(job, grid, progress=not args.json)
        else:
            from service.ray_launcher import run_on_ray

            result = run_on_ray(job, grid, plan, simulate=args.simulate, progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        if args.launcher != "ray":  # the Ray launcher prints it as the actors report in
            print_placement(result["placement"])
        losses = result["losses"]
        curve = f"; loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
        print(f"{result['job_id']}: {result['state']} after {result['iterations']} iterations in "
              f"{time.time() - t0:.1f}s{curve}")
        if result.get("error"):
            print(f"error: {result['error']}", file=sys.stderr)
    return 0 if result["state"] == "SUCCEEDED" else 1
