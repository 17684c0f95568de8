"""Data-parallel step time: raytron's trainer vs torch DistributedDataParallel (run by hand).

    .venv/bin/python -m bench.dp_vs_ddp [--iters 8] [--warmup 2] [--profile]

Both run in the same two gloo ranks, on the same model (``workers.model.decoder.ModelChunk`` with the
embedding and the output layer), the same global batch cut into the same microbatches, the
same loss (``sum of token losses / tokens in the global batch``) and AdamW:

* raytron: ``Trainer(job, rank, 2)`` with dp = 2, i.e. gradient accumulation through the
  pipeline executor (pp = 1), flat bucketed grad buffers whose all-reduce overlaps the last
  microbatch's backward, ``torch.optim.AdamW`` (the replicated optimizer);
* DDP: ``DistributedDataParallel`` around the single-process ``ModelChunk`` (no groups), every
  microbatch but the last under ``no_sync()``, the loss scaled by dp because DDP averages,
  ``torch.optim.AdamW`` with the same hyper-parameters (weight decay on 2-D params only, the
  same LR schedule), ``clip_grad_norm_`` at ``training.clip_grad``, batches from the same
  ``training.split``, and the same loss all-reduce for the reported value.

Iterations alternate (raytron, DDP, raytron, ...) so that load from other work on the machine
hits both alike; the first ``--warmup`` of each are dropped and the median of the rest is
reported per rank, plus the ratio. The losses of the two must agree (same init, same data, same
math): the largest difference is printed as a check that both do the same work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


from service.spec.spec import parse_spec, to_job_config  # noqa: E402
from workers.config import JobConfig  # noqa: E402

MODEL = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
         "ffn_hidden_size": 1024, "vocab_size": 256, "seq_length": 128}
TRAINING = {"train_iters": 100, "global_batch_size": 16, "micro_batch_size": 4, "lr": 1e-3, "seed": 11}
# Two regimes: compute-bound (the default model) and overhead-bound (tiny layers, 8 microbatches
# per rank, where per-microbatch Python and per-param hook costs would show).
CONFIGS = {
    "compute-bound": ({}, {}),
    "overhead-bound": ({"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                        "ffn_hidden_size": 256, "seq_length": 32}, {"global_batch_size": 32, "micro_batch_size": 2}),
}


def dp_job(world: int = 2, model: dict | None = None, training: dict | None = None) -> JobConfig:
    return to_job_config(parse_spec({
        "name": "dp-vs-ddp", "model": {**MODEL, **(model or {})}, "parallel": {},
        "training": {**TRAINING, **(training or {})}, "resources": {"num_nodes": 1, "gpus_per_node": world},
    }))


class DDPRunner:
    """The same training step written the way a torch user writes DDP."""

    def __init__(self, job: JobConfig, rank: int, world_size: int):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from workers.data.dataset import GlobalSampler
        from workers.train.lr_schedule import LRSchedule
        from workers.model.decoder import ModelChunk, ShardContext

        m, t = job.model, job.training
        self.job, self.rank, self.world_size = job, rank, world_size
        model = ModelChunk(m, ShardContext(seed=t.seed), list(range(m.num_layers)), pre_process=True,
                           post_process=True, positions=torch.arange(m.seq_length))
        self.model = DistributedDataParallel(model)
        params = list(self.model.parameters())
        # raytron's rules, which are spec defaults: no decay on 1-D params, clipping, the split.
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() > 1]},
             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
            lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
        self.lr_schedule = LRSchedule.from_config(t)
        self.sampler = GlobalSampler(t.data, m.seq_length, t.seed, t.global_batch_size, split=t.split)
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * world_size)
        self.tokens_per_iteration = t.global_batch_size * m.seq_length
        self.iteration = 0

    def train_step(self) -> dict:
        import contextlib

        import torch
        import torch.distributed as dist

        from workers.parallel.cross_entropy import vocab_parallel_cross_entropy

        t0 = time.perf_counter()
        t = self.job.training
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_schedule.lr_for_update(self.iteration)
        self.optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        per_rank = t.global_batch_size // self.world_size
        for mb in range(self.num_microbatches):
            start = self.rank * per_rank + mb * t.micro_batch_size
            tokens, labels = self.sampler.batch(self.iteration, start, t.micro_batch_size)
            last = mb == self.num_microbatches - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                logits = self.model(tokens.t())
                loss = vocab_parallel_cross_entropy(logits, labels.t(), None).sum() / self.tokens_per_iteration
                # DDP averages over ranks; raytron sums: scale so both apply the same gradient.
                (loss * self.world_size).backward()
            total += loss.detach()
        if t.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.clip_grad)
        self.optimizer.step()
        dist.all_reduce(total)
        self.iteration += 1
        return {"loss": float(total), "step_time_s": time.perf_counter() - t0}


def compare_rank(rank: int, world_size: int, job: JobConfig, iters: int, warmup: int, profile: bool = False) -> dict:
    """Alternate raytron and DDP iterations; return both step-time lists and losses."""
    import cProfile
    import io
    import pstats

    from workers.train.trainer import Trainer

    runners = {"raytron": Trainer(job, rank, world_size), "ddp": DDPRunner(job, rank, world_size)}
    times = {k: [] for k in runners}
    losses = {k: [] for k in runners}
    profiles = {k: cProfile.Profile() for k in runners} if profile and rank == 0 else {}
    for i in range(warmup + iters):
        for name, runner in runners.items():
            prof = profiles.get(name) if i >= warmup else None
            if prof:
                prof.enable()
            out = runner.train_step()
            if prof:
                prof.disable()
            losses[name].append(out["loss"])
            if i >= warmup:
                times[name].append(out["step_time_s"])
    report = {}
    for name, prof in profiles.items():
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        report[name] = buf.getvalue()
    return {"times": times, "losses": losses, "profiles": report}


def run(job: JobConfig | None = None, iters: int = 8, warmup: int = 2, profile: bool = False) -> dict:
    from tests.helpers.ranks import run_ranks

    job = job or dp_job()
    results = run_ranks(compare_rank, 2, args=(job, iters, warmup, profile), timeout_s=600)
    med = {name: max(statistics.median(r["times"][name]) for r in results) for name in ("raytron", "ddp")}
    # Paired: iteration i of raytron ran right before iteration i of DDP, under the same load;
    # a step takes as long as its slowest rank.
    slowest = {n: [max(ts) for ts in zip(*(r["times"][n] for r in results))] for n in ("raytron", "ddp")}
    paired = statistics.median(a / b for a, b in zip(slowest["raytron"], slowest["ddp"]))
    loss_diff = max(abs(a - b) for r in results for a, b in zip(r["losses"]["raytron"], r["losses"]["ddp"]))
    return {"median_s": med, "ratio": med["raytron"] / med["ddp"], "paired_ratio": paired, "loss_diff": loss_diff,
            "results": results, "job": job}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="timed iterations of each")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations of each")
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's timed steps")
    ap.add_argument("--only", default="", help="one of " + ", ".join(CONFIGS))
    args = ap.parse_args(argv)
    print(f"dp=2 on 2 gloo ranks; {args.warmup} warm-up + {args.iters} timed iterations of each, alternating; "
          "median of the slowest rank")
    print(f"{'config':<15} {'model':<38} {'raytron s':>10} {'ddp s':>8} {'ratio':>6} {'paired':>7} {'loss diff':>10}")
    outs = {}
    for name, (model, training) in CONFIGS.items():
        if args.only and name != args.only:
            continue
        job = dp_job(model=model, training=training)
        m, t = job.model, job.training
        desc = (f"L{m.num_layers} h{m.hidden_size} s{m.seq_length} gbs{t.global_batch_size} "
                f"mbs{t.micro_batch_size} ({t.global_batch_size // (2 * t.micro_batch_size)} mb/rank)")
        out = outs[name] = run(job, args.iters, args.warmup, args.profile)
        print(f"{name:<15} {desc:<38} {out['median_s']['raytron']:>10.4f} {out['median_s']['ddp']:>8.4f} "
              f"{out['ratio']:>6.3f} {out['paired_ratio']:>7.3f} {out['loss_diff']:>10.1e}")
    print("ratio = median raytron / median DDP; paired = median over iterations of raytron_i / ddp_i "
          "(target <= 1; a shared 2-core machine adds a few % of noise); loss diff: largest |loss| gap")
    for name, out in outs.items():
        for runner, text in out["results"][0]["profiles"].items():
            print(f"\n--- cProfile rank 0, {name}, {runner} ---\n{text}")


if __name__ == "__main__":
    main()
