"""FP8 emulation error against bf16 on the model's layers.

    .venv/bin/python -m bench.fp8_bench [--seq 256]

A two-layer decoder (hidden 256, 2 heads of 128, ffn 512: every dim a multiple of the 128-wide
blockwise tile) runs one microbatch forward and backward, in fp32 (the reference), in bf16, and
with its linears in FP8 (``training.fp8``, :mod:`workers.parallel.fp8`) for each recipe and
format, with fp32 or bf16 around them. Each row: the loss's error, the relative L2 error of the
logits, and the relative L2 error of every FP8-able linear's weight gradient (median and worst
over the layer's linears), all against fp32. Delayed scaling is measured on a second
microbatch, after one update of its scales from the first (the first iteration scales as
tensorwise), so its scales are a batch old as in training.
"""

from __future__ import annotations

import argparse
import statistics

import torch

MODEL = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 2, "num_query_groups": 2,
         "ffn_hidden_size": 512, "vocab_size": 512}


def _model(seq: int, dtype: torch.dtype, recipe):
    from service.spec.spec import parse_spec, to_job_config
    from workers.model.decoder import ModelChunk, ShardContext

    cfg = to_job_config(parse_spec({"name": "fp8-bench", "model": {**MODEL, "seq_length": seq}})).model
    chunk = ModelChunk(cfg, ShardContext(seed=3, fp8=recipe), list(range(cfg.num_layers)), pre_process=True,
                       post_process=True, positions=torch.arange(seq))
    return chunk.to(dtype)


def _pass(chunk, tokens, labels):
    import torch.nn.functional as F

    chunk.zero_grad(set_to_none=True)
    logits = chunk(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    grads = {n: p.grad.float() for n, p in chunk.named_parameters() if n.startswith("layers.") and p.dim() == 2}
    return float(loss.detach()), logits.detach().float(), grads


def measure(seq: int, dtype: torch.dtype, recipe) -> dict:
    from workers.parallel.fp8 import update_delayed_scales

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, MODEL["vocab_size"], (seq, 2), generator=g),
                torch.randint(0, MODEL["vocab_size"], (seq, 2), generator=g)) for _ in range(2)]
    runs = []
    for d, r in ((torch.float32, None), (dtype, recipe)):
        chunk = _model(seq, d, r)
        _pass(chunk, *batches[0])  # delayed: the first batch's amaxes become the second's scales
        update_delayed_scales([chunk], None)
        runs.append(_pass(chunk, *batches[1]))
    (loss0, logits0, grads0), (loss, logits, grads) = runs
    rel = [float((grads[n] - grads0[n]).norm() / grads0[n].norm()) for n in grads0]
    return {"loss_err": abs(loss - loss0), "logits_rel": float((logits - logits0).norm() / logits0.norm()),
            "wgrad_rel_median": statistics.median(rel), "wgrad_rel_max": max(rel)}


def main(argv: list[str] | None = None) -> int:
    from workers.parallel.fp8 import Fp8Recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = [("bf16", torch.bfloat16, None)]
    for around, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for fmt in ("hybrid", "e4m3"):
            for recipe in ("tensorwise", "delayed", "blockwise"):
                rows.append((f"{around} + fp8 {fmt} {recipe}", dtype, Fp8Recipe(fp8=fmt, recipe=recipe)))
    print(f"{'precision':34s} {'|loss err|':>11s} {'logits rel':>11s} {'wgrad rel (median)':>19s} {'(worst)':>9s}")
    for name, dtype, recipe in rows:
        m = measure(args.seq, dtype, recipe)
        print(f"{name:34s} {m['loss_err']:11.2e} {m['logits_rel']:11.2e} {m['wgrad_rel_median']:19.2e} "
              f"{m['wgrad_rel_max']:9.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
