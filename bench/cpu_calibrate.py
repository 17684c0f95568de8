"""Measure the simulated CPU cluster's figures on this machine (``service.spec.cost.CPU_FIGURES``).

    .venv/bin/python -m bench.cpu_calibrate [--ranks 8] [--json]

Every figure is measured with ``--ranks`` single-threaded rank processes (8: the 2 x 4 simulated
cluster) all working at once, as they do in a job, on the machine's ``os.cpu_count()`` cores:

* ``peak_tflops``: the machine's fp32 GEMM rate (512 x 512 matmuls): every rank's FLOPs over the
  slowest rank's time. An achieved rate, not a datasheet peak;
* ``intra_gbps`` / ``inter_gbps``: gloo's loopback throughput of all ranks together: an 8 MiB
  all-reduce in one group of all ranks, each rank sending ``2 (n-1)/n`` of it, less the time of
  a 4 KiB one (the latency), over the time;
* ``hop_latency_s``: per group size g (2, 4, 8), the wait per message of a collective with the
  cores busy: each rank alternates a 256 x 256 GEMM and a 4 KiB all-reduce in groups of g
  consecutive ranks, all groups at once (``2 (g-1)`` messages in a ring); the time above the
  GEMMs alone, per message, the median of ``repeats`` runs. (A message waits for its receiver to
  get a core: the more ranks in the chain, the longer each waits);
* ``memory_gbps``: the machine's memory bandwidth: every rank adds two 32 MiB tensors in place
  (3 x 32 MiB moved per add), all bytes over the wall time;
* ``process_mb``: what a rank process adds whatever the model: 4 ranks (dp 4) of a negligible
  model (h 32, seq 32, vocab 256) train 3 iterations; the largest ``VmHWM`` less the ``VmRSS``
  before the trainer was built (bench/auto_layout_bench.py's *fixed*; the torch import excluded).

The figures go into ``CPU_FIGURES`` by hand (with the load average at the time): the cost model
stays pure and deterministic. The machine's load (other people's work) lowers them all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time


KIB, MIB = 2**10, 2**20


def _gemm(rank: int, world_size: int, n: int, reps: int) -> tuple[float, float, float]:
    import torch
    import torch.distributed as dist

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    dist.barrier()
    t0 = time.time()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps, t0, time.time()


def _all_reduce(rank: int, world_size: int, nbytes: int, reps: int, gemm: int, group_size: int = 0) -> float:
    """Seconds per repetition of (a ``gemm`` x ``gemm`` matmul, then) an all-reduce of ``nbytes`` in
    groups of ``group_size`` consecutive ranks (0: all), every group at once."""
    import torch
    import torch.distributed as dist

    g = group_size or world_size
    groups = [dist.new_group(list(range(i, i + g))) for i in range(0, world_size, g)]
    group = groups[rank // g]
    x = torch.zeros(max(world_size, nbytes // 4))
    a = torch.randn(gemm, gemm) if gemm else None
    dist.all_reduce(x, group=group)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if a is not None:
            a @ a
        if nbytes:
            dist.all_reduce(x, group=group)
    return (time.perf_counter() - t0) / reps


def _add(rank: int, world_size: int, nbytes: int, reps: int) -> tuple[float, float, float]:
    import torch
    import torch.distributed as dist

    x, y = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
    x.add_(y)
    dist.barrier()
    t0 = time.time()
    for _ in range(reps):
        x.add_(y)
    return 3 * nbytes * reps, t0, time.time()


def _rate(out: list[tuple[float, float, float]]) -> float:
    """All ranks' work over the wall time from the first start to the last end."""
    return sum(w for w, _, _ in out) / (max(e for _, _, e in out) - min(s for _, s, _ in out))


def calibrate(ranks: int = 8, repeats: int = 3) -> dict:
    """The simulated CPU cluster's figures on this machine (module docstring)."""
    from tests.helpers.ranks import run_ranks

    def run(fn, *args):
        return run_ranks(fn, ranks, args=args, timeout_s=600)

    flops = _rate(run(_gemm, 512, 40))
    small = max(run(_all_reduce, 4 * KIB, 40, 0))
    large = max(run(_all_reduce, 8 * MIB, 8, 0))
    sent = ranks * 2 * (ranks - 1) / ranks * 8 * MIB
    loopback = sent / max(large - small, 1e-9)
    gemm_only = max(run(_all_reduce, 0, 40, 256))
    hops = {}
    for g in (2, 4, 8):
        if g <= ranks and ranks % g == 0:
            with_ar = statistics.median(max(run(_all_reduce, 4 * KIB, 40, 256, g)) for _ in range(repeats))
            hops[g] = round(max(with_ar - gemm_only, 0.0) / (2 * (g - 1)), 5)
    memory = _rate(run(_add, 32 * MIB, 20))
    from bench.auto_layout_bench import FIXED_MODEL, _measured_and_plan

    process, _ = _measured_and_plan(FIXED_MODEL, {}, 3)
    return {"peak_tflops": round(flops / 1e12, 4), "intra_gbps": round(loopback / 1e9, 3),
            "inter_gbps": round(loopback / 1e9, 3), "cores": os.cpu_count(), "hop_latency_s": hops,
            "memory_gbps": round(memory / 1e9, 2), "process_mb": round(process / MIB, 1), "ranks": ranks,
            "load": round(os.getloadavg()[0], 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="rank processes at once (default 8: the 2 x 4 cluster)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    figures = calibrate(args.ranks)
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"load before {load:.1f}; {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
