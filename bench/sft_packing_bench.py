"""Packing chat samples into rows: how full the rows are, and what it saves in step time.

    .venv/bin/python -m bench.sft_packing_bench             # seq 512, 600 samples
    .venv/bin/python -m bench.sft_packing_bench --seq 1024 --samples 400

Sample lengths are log-normal with mean ``seq / 8`` (a long tail up to ``seq``), as chat data's are.
**Efficiency**: the share of row slots holding a real token, packed best-fit-decreasing
(:func:`workers.data.chat.pack`) against one sample per row padded to ``seq``. **Time**: one
process trains a small model (2 layers, h 128, fp32) over every sample once, 4 rows per step,
forward and backward with per-document attention (:mod:`workers.data.packing`), packed and padded,
side by side: the same tokens, the same loss (the mean over the loss tokens), fewer rows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from workers.data.chat import make_row, pack
from workers.data.packing import pack_rows


def rows_of(groups, samples, s):
    """Packed rows of the sample groups, every label in the loss (:func:`workers.data.chat.make_row`)."""
    return [make_row([(samples[i], np.ones(len(samples[i]), np.float32)) for i in group], s) for group in groups]


def train_time(chunk, rows, per_step: int) -> float:
    from workers.parallel.cross_entropy import vocab_parallel_cross_entropy

    t0 = time.perf_counter()
    for k in range(0, len(rows), per_step):
        batch = pack_rows(rows[k:k + per_step])
        logits = chunk(batch.tokens.t(), packing=(batch.position_ids.t(), batch.cu_seqlens))
        losses = vocab_parallel_cross_entropy(logits, batch.labels.t(), None) * batch.loss_mask.t()
        (losses.sum() / batch.loss_mask.sum()).backward()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--samples", type=int, default=600)
    args = parser.parse_args(argv)
    s = args.seq
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(s / 8) - 0.5, 1.0, args.samples).astype(int), 2, s + 1)
    samples = [rng.integers(0, 256, n) for n in lengths]
    packed = pack(lengths - 1, s, seed=1)
    padded_rows = rows_of([[i] for i in range(len(samples))], samples, s)
    packed_rows = rows_of(packed.rows, samples, s)
    real = float((lengths - 1).sum())

    from service.spec.spec import parse_spec, to_job_config
    from workers.model.decoder import ModelChunk, ShardContext

    torch.manual_seed(0)
    cfg = to_job_config(parse_spec({"name": "bench", "model": {"num_layers": 2, "hidden_size": 128,
                                                               "num_attention_heads": 4, "seq_length": s}})).model
    chunk = ModelChunk(cfg, ShardContext(seed=1), [0, 1], pre_process=True, post_process=True,
                       positions=torch.arange(s))
    train_time(chunk, packed_rows[:4], 4)  # warm-up
    times = {name: train_time(chunk, rows, 4) for name, rows in (("padded", padded_rows), ("packed", packed_rows))}
    print(f"seq {s}, {len(samples)} samples, lengths log-normal mean {lengths.mean():.0f} (max {lengths.max()})")
    print(f"{'':8} {'rows':>6} {'efficiency':>11} {'epoch s':>9} {'tokens/s':>10}")
    for name, rows in (("padded", padded_rows), ("packed", packed_rows)):
        print(f"{name:8} {len(rows):>6} {real / (len(rows) * s):>11.3f} {times[name]:>9.2f} {real / times[name]:>10.0f}")
    print(f"packed / padded time: {times['packed'] / times['padded']:.2f}")


if __name__ == "__main__":
    main()
