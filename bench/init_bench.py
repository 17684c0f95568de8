"""Model init time per rank at tp1 / tp2 / tp4 for a model with a large embedding (run by hand).

    .venv/bin/python -m bench.init_bench

Each rank builds its shard of the whole model (``ModelChunk``, pp = 1) and reports the CPU
time it took (``time.process_time``: the ranks share a few cores with whatever else runs, so
wall time measures the neighbours) and the number of parameter elements it holds. Initial values are a pure function of
(seed, name, full shape) computed per element (:mod:`workers.parallel.initializer`), so a rank
computes only its shard: time falls with the shard. For scale, the last line is what every
rank used to pay whatever its shard: drawing every full tensor with ``torch.randn`` (then
slicing), which is O(model) per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


from service.spec.spec import parse_spec, to_job_config  # noqa: E402

MODEL = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 4,
         "ffn_hidden_size": 1024, "vocab_size": 65536, "seq_length": 64}


def job(tp: int):
    return to_job_config(parse_spec({
        "name": "init-bench", "model": MODEL,
        "parallel": {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1},
        "training": {"train_iters": 1, "global_batch_size": 1, "micro_batch_size": 1},
        "resources": {"num_nodes": 1, "gpus_per_node": tp},
    }))


def _rank(rank: int, world_size: int, job_config) -> dict:
    import torch

    from workers.grid import ParallelGrid
    from workers.parallel.groups import build_process_groups
    from workers.model.decoder import ModelChunk, ShardContext
    from workers.parallel.initializer import NormalInit

    torch.set_num_threads(1)
    grid = ParallelGrid.from_config(job_config.parallel, world_size)
    groups = build_process_groups(grid, rank)
    ctx = ShardContext(tp_group=groups.tp_group, sequence_parallel=job_config.parallel.sequence_parallel,
                       seed=job_config.training.seed)
    NormalInit(0, "warm-up", (4, 4), 1.0).materialize()  # first-use costs out of the timing
    t0 = time.process_time()
    chunk = ModelChunk(job_config.model, ctx, list(range(job_config.model.num_layers)), pre_process=True,
                       post_process=True, positions=torch.arange(job_config.model.seq_length))
    seconds = time.process_time() - t0
    return {"seconds": seconds, "elements": sum(p.numel() for p in chunk.parameters())}


def full_draw_seconds() -> tuple[float, int]:
    """What a rank paid before: ``torch.randn`` of every full tensor (the slicing is free)."""
    import torch

    from workers.model.decoder import ModelChunk, ShardContext

    torch.set_num_threads(1)
    chunk = ModelChunk(job(1).model, ShardContext(), list(range(MODEL["num_layers"])), pre_process=True,
                       post_process=True, positions=torch.arange(MODEL["seq_length"]))
    shapes = [tuple(p.shape) for p in chunk.parameters()]
    g = torch.Generator().manual_seed(0)
    t0 = time.process_time()
    for shape in shapes:
        torch.randn(*shape, generator=g)
    return time.process_time() - t0, sum(torch.Size(s).numel() for s in shapes)


def main() -> None:
    argparse.ArgumentParser(prog="python -m bench.init_bench", description=__doc__.split("\n\n")[0]).parse_args()
    from tests.helpers.ranks import run_ranks

    print(f"model: vocab {MODEL['vocab_size']} x h {MODEL['hidden_size']} (embedding + output), "
          f"{MODEL['num_layers']} layers, ffn {MODEL['ffn_hidden_size']}; one thread per rank")
    print(f"{'layout':<6} {'elements/rank':>14} {'init CPU s/rank (max)':>22} {'vs tp1':>7}")
    base = None
    for tp in (1, 2, 4):
        results = run_ranks(_rank, tp, args=(job(tp),), timeout_s=600) if tp > 1 else [_rank(0, 1, job(1))]
        seconds = max(r["seconds"] for r in results)
        base = base or seconds
        print(f"tp{tp:<4} {max(r['elements'] for r in results):>14,} {seconds:>22.2f} {seconds / base:>7.2f}")
    seconds, elements = full_draw_seconds()
    print(f"before: every rank drew all {elements:,} elements with torch.randn: {seconds:.2f} CPU s per rank at any tp")


if __name__ == "__main__":
    main()
