"""Single-GPU training throughput and MFU of raytron's training step, side by side per precision.

Runs the real ``Trainer`` (the same code every rank runs) on one CUDA device for a Llama-style
model of about 0.9 B parameters, and prints, per precision mode (``fp32``, ``tf32`` matmuls,
``bf16``: ``training.bf16`` mixed precision with fp32 main params and grads), the step time, tokens/s,
achieved model TFLOP/s and MFU against the device's peak for that precision. Also checks that a
one-rank nccl process group (the multi-GPU code path: init, groups, collectives) trains the tiny
parity job to the CPU reference curve.

Model FLOPs per token follow the PaLM / Megatron convention: 6 x (matmul parameters) for the
forward and backward passes plus 12 x layers x hidden x seq for attention scores and values
(no causal discount), so MFU is comparable with published figures.

    python -m bench.gpu_throughput [--layers 16 --hidden 2048 --seq 2048 --gbs 8 --mbs 2]

Needs CUDA; exits 0 with a message without it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


import torch  # noqa: E402

# Dense peaks of an H200 SXM (vendor datasheet), TFLOP/s.
PEAK_TFLOPS = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4}


def model_spec(args) -> dict:
    return {
        "name": "gpu-bench",
        "model": {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.heads,
                  "num_query_groups": args.query_groups, "ffn_hidden_size": args.ffn, "vocab_size": args.vocab,
                  "seq_length": args.seq},
        "training": {"train_iters": args.warmup + args.iters, "global_batch_size": args.gbs,
                     "micro_batch_size": args.mbs, "lr": 1e-4, "seed": 1},
        "resources": {"num_nodes": 1, "gpus_per_node": 1},
    }


def flops_per_token(m) -> tuple[int, int]:
    """(matmul parameters, model FLOPs per token)."""
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    kv = m.num_query_groups * m.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f
    matmul_params = L * per_layer + h * m.vocab_size  # the output layer; the embedding is a lookup
    return matmul_params, 6 * matmul_params + 12 * L * h * m.seq_length


def run_mode(job, mode: str, warmup: int, iters: int, device: torch.device | None = None) -> dict:
    """Build the job's trainer in ``mode`` on ``device`` (default the first GPU) and time its steps."""
    import dataclasses

    from workers.train.trainer import Trainer

    if mode == "bf16":  # the model in bf16, fp32 main params / grads (training.bf16: true)
        job = dataclasses.replace(job, training=dataclasses.replace(job.training, bf16=True))
    device = device or torch.device("cuda", 0)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = Trainer(job, 0, 1, device=device)
    build_s = time.perf_counter() - t0
    losses = []
    for _ in range(warmup):
        losses.append(trainer.train_step()["loss"])
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        losses.append(trainer.train_step()["loss"])
    sync()
    step_s = (time.perf_counter() - t0) / iters
    n_params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    del trainer
    if cuda:
        torch.cuda.empty_cache()
    return {"mode": mode, "build_s": build_s, "step_s": step_s, "params": n_params, "losses": losses,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def nccl_world_of_one_check() -> str:
    """A one-rank job through run_ranks: init_process_group('nccl'), groups, collectives."""
    from tests.helpers.parity import ITERS, assert_same_curve, job_of, reference, tiny_spec
    from tests.helpers.ranks import run_ranks

    from bench import gpu_ranks

    job = job_of(tiny_spec(world=1))
    losses, devices = run_ranks(gpu_ranks.losses_on_gpu, 1, args=(job, ITERS), start_method="spawn",
                                backend="nccl")[0]
    assert devices == ["cuda:0"], devices
    ref = reference()["losses"]
    assert_same_curve(losses, ref, rtol=1e-3)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    return (f"nccl world-of-1 (parameters on {devices[0]}): {len(losses)} iterations match the CPU reference "
            f"(worst rel {worst:.1e})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--query-groups", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--modes", default="fp32,tf32,bf16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device; nothing measured")
        return 0
    from service.spec.spec import parse_spec, to_job_config

    job = to_job_config(parse_spec(model_spec(args)))
    matmul_params, fpt = flops_per_token(job.model)
    tokens = args.gbs * args.seq
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, heads {args.heads}/{args.query_groups}, "
          f"vocab {args.vocab}, seq {args.seq}; {matmul_params / 1e9:.3f} B matmul params; "
          f"global batch {args.gbs} x {args.seq} = {tokens} tokens ({args.gbs // args.mbs} microbatches of {args.mbs})")
    rows = []
    for mode in args.modes.split(","):
        r = run_mode(job, mode, args.warmup, args.iters)
        tflops = fpt * tokens / r["step_s"] / 1e12
        r.update(tokens_per_s=tokens / r["step_s"], tflops=tflops, mfu=tflops / PEAK_TFLOPS[mode])
        rows.append(r)
        print(f"  {mode}: losses {' '.join(f'{x:.4f}' for x in r['losses'])}", flush=True)
    print(f"\n{'matmul':>8}{'params':>10}{'build s':>9}{'step s':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'peak':>8}"
          f"{'MFU':>8}{'mem GiB':>9}")
    for r in rows:
        print(f"{r['mode']:>8}{r['params'] / 1e9:>9.3f}B{r['build_s']:>9.1f}{r['step_s']:>9.3f}{r['tokens_per_s']:>11.0f}"
              f"{r['tflops']:>9.1f}{PEAK_TFLOPS[r['mode']]:>8.0f}{r['mfu']:>8.1%}{r['peak_gib']:>9.1f}")
    if len(rows) > 1:
        print(f"speed-up {rows[-1]['mode']} / {rows[0]['mode']}: {rows[0]['step_s'] / rows[-1]['step_s']:.2f}x; "
              f"first-iteration loss difference {abs(rows[0]['losses'][0] - rows[-1]['losses'][0]):.2e}")
    print(nccl_world_of_one_check())
    return 0


if __name__ == "__main__":
    sys.exit(main())
