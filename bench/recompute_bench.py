"""Activation recomputation: saved-activation memory per rank and step time, with and without.

    .venv/bin/python -m bench.recompute_bench [--tp 2] [--iters 3]

For each ``recompute_granularity`` / ``recompute_method`` setting one microbatch's forward +
loss runs under ``torch.autograd.graph.saved_tensors_hooks``; every storage autograd keeps
for backward is counted once (parameters and buffers excluded), plus the inputs that each
recomputed region holds on to (the region's own saves are not made: that is the point).
That is the saved-activation footprint at the end of the forward. Step time is the fastest
of full training iterations (forward, recompute, backward, optimizer). Ranks run as local
processes (gloo on CPU); the numbers are the max over ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


MODEL = {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 4,
         "ffn_hidden_size": 512, "vocab_size": 256, "seq_length": 512}
SETTINGS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full-uniform-1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full-uniform-2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full-block-2": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
}
MIB = 2**20


def job(setting: str, tp: int, model: dict | None = None, training: dict | None = None):
    from service.spec.spec import parse_spec, to_job_config

    spec = {"name": "recompute-bench", "model": {**(model or MODEL), **SETTINGS[setting]},
            "parallel": {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1},
            "training": {"train_iters": 10, "global_batch_size": 2, "micro_batch_size": 1, "eval_interval": None,
                         **(training or {})},
            "resources": {"num_nodes": 1, "gpus_per_node": tp}}
    return to_job_config(parse_spec(spec))


def saved_bytes(trainer) -> int:
    """Bytes kept for backward by microbatch 0's forward + loss on this rank (see module doc)."""
    import torch

    import workers.parallel.recompute as recompute
    from workers.parallel.cross_entropy import vocab_parallel_cross_entropy

    static = {t.untyped_storage().data_ptr() for c in trainer.chunks for t in list(c.parameters()) + list(c.buffers())}
    seen: dict[int, int] = {}

    def record(t):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in static and key not in seen:
                seen[key] = storage.nbytes()
        return t

    original = recompute.checkpoint

    def counting_checkpoint(fn, *args, **kwargs):
        for a in args:  # a recomputed region keeps its inputs alive until its backward
            record(a)
        return original(fn, *args, **kwargs)

    recompute.checkpoint = counting_checkpoint
    try:
        tokens, labels = trainer._microbatch(0)
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            loss = vocab_parallel_cross_entropy(trainer.chunks[0](tokens).float(), labels, trainer.groups.tp_group).sum()
        del loss
    finally:
        recompute.checkpoint = original
    return sum(seen.values())


def _rank(rank: int, world_size: int, job_config, iters: int) -> dict:
    from workers.train.trainer import Trainer

    trainer = Trainer(job_config, rank, world_size)
    saved = saved_bytes(trainer)
    trainer.train_step()  # warm-up
    times = [trainer.train_step()["step_time_s"] for _ in range(iters)]
    return {"saved": saved, "step_s": min(times)}  # min: the machine is shared, noise only adds


def measure(setting: str, tp: int = 1, iters: int = 3, model: dict | None = None) -> dict:
    """Max over ranks of saved bytes and fastest step time for one setting."""
    from tests.helpers.ranks import run_ranks

    cfg = job(setting, tp, model)
    results = run_ranks(_rank, tp, args=(cfg, iters), timeout_s=600) if tp > 1 else [_rank(0, 1, cfg, iters)]
    return {k: max(r[k] for r in results) for k in ("saved", "step_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    m = MODEL
    print(f"model: {m['num_layers']} layers, h {m['hidden_size']}, ffn {m['ffn_hidden_size']}, seq {m['seq_length']}, "
          f"micro batch 1, tp {args.tp}{' + sp' if args.tp > 1 else ''}; per rank, max over ranks")
    print(f"{'recompute':<16} {'saved MiB':>10} {'vs none':>8} {'step s':>8} {'vs none':>8}")
    base = None
    start = time.perf_counter()
    for name in SETTINGS:
        r = measure(name, args.tp, args.iters)
        base = base or r
        print(f"{name:<16} {r['saved'] / MIB:>10.2f} {r['saved'] / base['saved']:>8.3f} {r['step_s']:>8.3f} "
              f"{r['step_s'] / base['step_s']:>8.3f}", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
