"""Activation memory per rank under context parallelism, and CP / EP bytes (run by hand).

    .venv/bin/python bench/cp_memory.py

**Memory.** For cp = 1, 2, 4 (both ``cp_comm_type`` for cp > 1) a long-sequence model runs the
forward (and loss) of one microbatch under ``torch.autograd.graph.saved_tensors_hooks``; the
pack hook records every tensor autograd saves for backward, each storage once (views share
their storage), parameters and buffers excluded. Nothing saved is freed before backward, so
the sum at the end of the forward is the peak saved-activation footprint, exactly and
deterministically (no allocator noise). It is split into the attention core (inside
``context_parallel_attention``) and everything else, and printed with its ratio to cp = 1
and the ideal ``1/cp``. Everything outside the attention core is per token, so it should be
``1/cp`` of cp = 1; the attention core is not comparable across cp: cp = 1 (and the
``all_gather`` variant) materialise the ``[s_q, s_k]`` probabilities, while ring attention
saves only q, k, v, the output and the log-sum-exp (FlashAttention's recipe) and recomputes.
A storage saved in both places counts where it was saved first (the ring saves the attention
output itself, so its "other" lacks the proj input that the other paths count there).

**Bytes.** The same runs then train two iterations and the CP traffic of the second is
compared with the analytic minimum of :mod:`comm_bench` (``3 (cp-1)`` K/V blocks per layer per
microbatch for the ring, ``2 (cp-1)`` for all-gather), and an MoE variant of the model does
the same for EP = 2, 4 (routed token rows, from the actual routing).
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.comm_bench import Layout, compare, header, layout_job, measure_trainer, print_table  # noqa: E402
from workers.config import JobConfig  # noqa: E402

LONG_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 1024}
MIB = 2**20


def cp_layout(cp: int, comm_type: str = "p2p") -> Layout:
    return Layout(f"cp{cp}-{comm_type}", {"context_parallel_size": cp, "cp_comm_type": comm_type})


def long_job(layout: Layout, world: int, global_batch: int = 1) -> JobConfig:
    return layout_job(layout, world, model=LONG_MODEL,
                      training={"global_batch_size": global_batch, "micro_batch_size": 1})


def saved_activation_bytes(trainer) -> dict[str, int]:
    """Bytes autograd saves for backward during the forward + loss of microbatch 0.

    Returns ``{"attention": ..., "other": ..., "total": ...}``; each storage counted once,
    parameters and buffers excluded.
    """
    import torch

    import workers.model as model_module
    from workers.parallel.tensor import vocab_parallel_cross_entropy

    assert len(trainer.chunks) == 1 and trainer.grid.pp == 1, "one stage holding the whole model"
    chunk = trainer.chunks[0]
    static = {t.untyped_storage().data_ptr() for t in list(chunk.parameters()) + list(chunk.buffers())}
    seen: dict[int, tuple[int, str]] = {}
    where = {"in": "other"}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in static and key not in seen:
            seen[key] = (storage.nbytes(), where["in"])
        return t

    original = model_module.context_parallel_attention

    def attention(*args, **kwargs):
        where["in"] = "attention"
        try:
            return original(*args, **kwargs)
        finally:
            where["in"] = "other"

    model_module.context_parallel_attention = attention
    try:
        tokens, labels = trainer._microbatch(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = chunk(tokens)
            loss = vocab_parallel_cross_entropy(logits, labels, trainer.groups.tp_group).sum()
        del logits, loss  # drop the graph (and what it saved) without a backward
    finally:
        model_module.context_parallel_attention = original
    out = {"attention": 0, "other": 0}
    for nbytes, kind in seen.values():
        out[kind] += nbytes
    out["total"] = out["attention"] + out["other"]
    return out


def memory_and_bytes_rank(rank: int, world_size: int, job: JobConfig) -> dict:
    from workers.train import Trainer

    trainer = Trainer(job, rank, world_size)
    memory = saved_activation_bytes(trainer) if not job.model.is_moe else {}
    return {**measure_trainer(trainer), "memory": memory}


def run(layout: Layout, world: int, global_batch: int = 1):
    from workers.spawn import run_ranks

    job = long_job(layout, world, global_batch)
    results = run_ranks(memory_and_bytes_rank, world, args=(job,), timeout_s=300)
    return job, results


def main() -> None:
    t0 = time.perf_counter()
    m = LONG_MODEL
    print(f"model: {m['num_layers']} layers, h {m['hidden_size']}, heads {m['num_attention_heads']} "
          f"(kv {m['num_query_groups']}), ffn {m['ffn_hidden_size']}, seq {m['seq_length']}, micro batch 1")
    runs = [(cp_layout(1), 1)] + [(cp_layout(cp, ct), cp) for cp in (2, 4) for ct in ("p2p", "all_gather")]
    outputs = [(layout, *run(layout, world)) for layout, world in runs]

    print("\nsaved activations of one microbatch's forward + loss, per rank (max over ranks), MiB")
    print(f"{'cp':>3} {'comm':<11} {'total':>8} {'attn core':>10} {'other':>8} {'total/cp1':>10} "
          f"{'other/cp1':>10} {'ideal':>6}")
    base = None
    for layout, job, results in outputs:
        cp = job.parallel.context_parallel_size
        mem = {k: max(r["memory"][k] for r in results) for k in ("total", "attention", "other")}
        base = base or mem
        comm_type = job.parallel.cp_comm_type if cp > 1 else "-"
        print(f"{cp:>3} {comm_type:<11} {mem['total'] / MIB:>8.2f} {mem['attention'] / MIB:>10.2f} "
              f"{mem['other'] / MIB:>8.2f} {mem['total'] / base['total']:>10.3f} "
              f"{mem['other'] / base['other']:>10.3f} {1 / cp:>6.3f}")

    print("\nCP and EP bytes of one iteration (second of two) vs the analytic minimum")
    header()
    for layout, job, results in outputs[1:]:
        rows = [r for r in compare(job, results) if r.traffic == "cp"]
        print_table(f"{layout.name} s{m['seq_length']}", rows)
    for ep in (2, 4):
        layout = Layout(f"ep{ep}-moe", {"expert_model_parallel_size": ep}, moe=True)
        job, results = run(layout, ep, global_batch=ep)
        rows = [r for r in compare(job, results) if r.traffic in ("ep", "grads:dense", "grads:expert")]
        print_table(f"{layout.name} s{m['seq_length']}", rows)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
