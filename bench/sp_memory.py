"""Saved activations per rank with tensor + sequence parallelism against tp = 1 (run by hand).

    .venv/bin/python -m bench.sp_memory

For tp = 1, 2, 4 (with and without sequence parallelism) one microbatch's forward + loss runs
under ``torch.autograd.graph.saved_tensors_hooks``; every storage autograd saves for backward
is counted once (parameters and buffers excluded), which is the exact saved-activation
footprint at the end of the forward (nothing is freed before backward). Bytes saved inside
the decoder layers are reported apart from the rest (embedding, final norm, logits and
loss), and each is divided by tp = 1's.

With SP every activation of a layer is either sequence-sharded (norms, residuals, routers) or
TP-sharded (attention heads, MLP ffn): Megatron's ideal is ``1/tp``. A column-parallel layer
therefore saves its input *shard* and gathers it again in backward
(:class:`workers.parallel.tensor._LinearWithSequenceGather`); saving the gathered input, as
``F.linear`` would, keeps a full-sequence tensor per layer and stops tp2 at ~0.6. Without SP
the replicated norm and residual activations stay whole on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys


from bench.comm_bench import Layout, layout_job  # noqa: E402

MODEL = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 4,
         "ffn_hidden_size": 512, "vocab_size": 256, "seq_length": 512}
MIB = 2**20


def saved_bytes(trainer) -> dict[str, int]:
    """Bytes autograd saves during microbatch 0's forward + loss: ``layers``, ``other``, ``total``."""
    import torch

    import workers.model.decoder as model_module
    from workers.parallel.cross_entropy import vocab_parallel_cross_entropy

    assert len(trainer.chunks) == 1, "one stage holding the whole model"
    chunk = trainer.chunks[0]
    static = {t.untyped_storage().data_ptr() for t in list(chunk.parameters()) + list(chunk.buffers())}
    seen: dict[int, tuple[int, str]] = {}
    where = {"in": "other"}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in static and key not in seen:
            seen[key] = (storage.nbytes(), where["in"])
        return t

    original = model_module.DecoderLayer.forward

    def layer_forward(self, *args):
        where["in"] = "layers"
        try:
            return original(self, *args)
        finally:
            where["in"] = "other"

    model_module.DecoderLayer.forward = layer_forward
    try:
        tokens, labels = trainer._microbatch(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = vocab_parallel_cross_entropy(chunk(tokens), labels, trainer.groups.tp_group).sum()
        del loss
    finally:
        model_module.DecoderLayer.forward = original
    out = {"layers": 0, "other": 0}
    for nbytes, kind in seen.values():
        out[kind] += nbytes
    out["total"] = out["layers"] + out["other"]
    return out


def _rank(rank: int, world_size: int, job) -> dict:
    from workers.train.trainer import Trainer

    return saved_bytes(Trainer(job, rank, world_size))


def measure(tp: int, sp: bool, model: dict | None = None) -> dict[str, int]:
    """Max over the tp ranks of :func:`saved_bytes` for one tp / SP setting."""
    from tests.helpers.ranks import run_ranks

    layout = Layout(f"tp{tp}{'-sp' if sp else ''}", {"tensor_model_parallel_size": tp, "sequence_parallel": sp})
    job = layout_job(layout, tp, model=model or MODEL, training={"global_batch_size": 1, "micro_batch_size": 1})
    results = run_ranks(_rank, tp, args=(job,), timeout_s=300) if tp > 1 else [_rank(0, 1, job)]
    return {k: max(r[k] for r in results) for k in ("layers", "other", "total")}


def main() -> None:
    argparse.ArgumentParser(prog="python -m bench.sp_memory", description=__doc__.split("\n\n")[0]).parse_args()
    m = MODEL
    print(f"model: {m['num_layers']} layers, h {m['hidden_size']}, heads {m['num_attention_heads']}, "
          f"ffn {m['ffn_hidden_size']}, seq {m['seq_length']}, micro batch 1")
    print("saved activations of one microbatch's forward + loss, per rank (max over ranks)")
    print(f"{'layout':<8} {'layers MiB':>11} {'total MiB':>10} {'layers/tp1':>11} {'total/tp1':>10} {'ideal':>6}")
    base = measure(1, False)
    for tp, sp in [(1, False), (2, True), (4, True), (2, False), (4, False)]:
        mem = base if tp == 1 else measure(tp, sp)
        name = f"tp{tp}{'+sp' if sp else ''}"
        print(f"{name:<8} {mem['layers'] / MIB:>11.3f} {mem['total'] / MIB:>10.3f} "
              f"{mem['layers'] / base['layers']:>11.3f} {mem['total'] / base['total']:>10.3f} {1 / tp:>6.3f}")


if __name__ == "__main__":
    main()
