"""Everything worth measuring on one GPU, in one run of under 5 minutes, written as JSON.

    python -m bench.gpu_suite [--out gpu_suite.json]      # on a CUDA machine ($OUT/gpu_suite.json when OUT is set)
    python -m bench.gpu_suite --smoke                      # a tiny CPU version of every section (the test suite runs it)

Sections (each key of the JSON; each also printed as one line):

* ``steps``: the real ``Trainer`` (what every rank runs) on the 0.89 B Llama-style model of
  ``bench/gpu_throughput.py``, fp32 and bf16 (``training.bf16``: fp32 main params and grads):
  step time, tokens/s, peak memory, and MFU against the device's dense peak by Megatron's FLOP
  formula (``num_floating_point_operations`` in megatron/training/training.py: causal
  attention counted half) next to the PaLM convention (attention counted whole).
  ``bf16+fp8``: bf16 with ``training.fp8: hybrid``, ``fp8_recipe: tensorwise``, the FP8 linears'
  GEMMs through ``torch._scaled_mm`` (``training.fp8_gemm: scaled_mm``, e4m3 x e4m3 forward,
  e5m2 x e4m3 backward, :mod:`workers.parallel.fp8_gemm`); ``bf16+fp8-emulated`` the same with
  ``fp8_gemm: emulated`` (the operands quantised and dequantised, the GEMMs in fp32). Both MFUs
  against the bf16 peak: what FP8 buys over bf16 at the same FLOPs.
* ``sdpa_backend``: the backend torch's dispatcher picks for the model's attention call
  (``torch._fused_sdp_choice`` on its shapes, per dtype): flash, cuDNN, efficient or math.
* ``profile``: one bf16 step under ``torch.profiler``: device time by kernel class (GEMM,
  attention, elementwise, reduction, optimizer, copies, communication), kernel count, and the
  busy fraction of the step's wall time.
* ``host_syncs``: the synchronising calls one bf16 step makes (``torch.cuda.set_sync_debug_mode``
  warnings, counted).
* ``ring_attention``: one CP rank's share of causal attention at seq 16384, cp 2, as the ring
  computes it (fused-kernel blocks merged by log-sum-exp, forward and backward), against the
  fused kernel over the whole sequence: time and peak memory (ideal: half the whole).
* ``moe_gemm``: the SwiGLU experts of one MoE layer (8 experts, top-2, 8192 tokens), forward and
  backward, as the product runs them (one grouped GEMM per projection: ``torch._grouped_mm``
  where the device has it, else one padded batched GEMM) against the per-expert loop.

Without CUDA (and without ``--smoke``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from contextlib import contextmanager


import torch  # noqa: E402

from bench.gpu_throughput import PEAK_TFLOPS, flops_per_token, model_spec, run_mode  # noqa: E402

BENCH = dict(layers=16, hidden=2048, heads=16, query_groups=8, ffn=5632, vocab=32000, seq=2048, gbs=8, mbs=2,
             warmup=2, iters=5)
SMOKE = dict(layers=2, hidden=64, heads=4, query_groups=2, ffn=128, vocab=256, seq=64, gbs=4, mbs=2, warmup=1,
             iters=2)

KERNEL_CLASSES = (  # first match wins; lower-case substrings of kernel names
    ("attention", ("flash", "fmha", "attention", "cudnn_sdpa", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "sm90_", "sm80_", "::mm", "::bmm", "addmm",
              "::linear", "grouped_mm")),
    ("communication", ("nccl", "allreduce", "allgather", "reducescatter")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("memcpy", "memset", "copy_", "cat", "index")),
    ("reduction", ("reduce", "sum", "norm", "softmax", "logsumexp")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton")),
)


def megatron_flops_per_token(m) -> float:
    """Training FLOPs per token by Megatron's formula for a dense SwiGLU GQA model: 12 h^2 L x
    (attention (1 + groups/heads + s/(2h)) + MLP 1.5 f/h + logits V/(2 L h)); causal attention halved."""
    h, L, s = m.hidden_size, m.num_layers, m.seq_length
    q_ratio = m.num_attention_heads * m.head_dim / h
    attention = (1 + m.num_query_groups / m.num_attention_heads + s / h / 2) * q_ratio
    mlp = m.ffn_hidden_size / h * 1.5
    logits = m.vocab_size / (2 * L * h)
    return 12 * L * h * h * (attention + mlp + logits)


def classify(name: str) -> str:
    low = name.lower()
    for cls, needles in KERNEL_CLASSES:
        if any(n in low for n in needles):
            return cls
    return "other"


@contextmanager
def _timed():
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    box = {"t0": time.perf_counter()}
    yield box
    sync()
    box["s"] = time.perf_counter() - box["t0"]


def _peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def steps(job, device, cfg: dict, peak: dict) -> list[dict]:
    m = job.model
    tokens = cfg["gbs"] * cfg["seq"]
    rows = []
    import dataclasses

    # bf16+fp8: training.fp8 hybrid, tensorwise (workers/parallel/fp8.py), its GEMMs through _scaled_mm or
    # emulated (workers/parallel/fp8_gemm.py), its MFU against the bf16 peak
    def fp8(gemm):
        return dataclasses.replace(job, training=dataclasses.replace(job.training, fp8="hybrid", fp8_recipe="tensorwise",
                                                                     fp8_gemm=gemm))
    for mode, run in (("fp32", job), ("bf16", job), ("bf16+fp8", fp8("scaled_mm")),
                      ("bf16+fp8-emulated", fp8("emulated"))):
        r = run_mode(run, "fp32" if mode == "fp32" else "bf16", cfg["warmup"], cfg["iters"], device=device)
        step_s = r["step_s"]
        megatron = megatron_flops_per_token(m) * tokens / step_s / 1e12
        palm = flops_per_token(m)[1] * tokens / step_s / 1e12
        rows.append({"mode": mode, "step_s": step_s, "tokens_per_s": tokens / step_s, "params": r["params"],
                     "peak_gib": r["peak_gib"], "tflops_megatron": megatron, "tflops_palm": palm,
                     "mfu_megatron": megatron / peak[mode.split("+")[0]] if peak else None,
                     "mfu_palm": palm / peak[mode.split("+")[0]] if peak else None, "first_loss": r["losses"][0]})
    return rows


def sdpa_backend(job, device) -> dict:
    """The backend SDPA picks for the model's causal GQA attention call, per dtype."""
    from torch.nn.attention import SDPBackend

    m, b = job.model, job.training.micro_batch_size
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        q = torch.empty(b, m.num_attention_heads, m.seq_length, m.head_dim, device=device, dtype=dtype)
        kv = torch.empty(b, m.num_query_groups, m.seq_length, m.head_dim, device=device, dtype=dtype)
        try:
            choice = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, enable_gqa=True)
            out[name] = SDPBackend(choice).name
        except Exception as e:  # noqa: BLE001 - a build without the probe: say so
            out[name] = f"unknown ({type(e).__name__}: {e})"
    return out


def profile_step(trainer, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trainer.train_step()  # warm
    with _timed() as wall, profile(activities=activities) as prof:
        trainer.train_step()
    by_class: dict[str, float] = {}
    kernels = 0
    for evt in prof.key_averages():
        if device.type == "cuda":
            t = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
            if not t:
                continue
        else:
            if not evt.key.startswith("aten::"):
                continue
            t = evt.self_cpu_time_total
        kernels += evt.count
        cls = classify(evt.key)
        by_class[cls] = by_class.get(cls, 0.0) + t / 1e6
    busy = sum(by_class.values())
    return {"wall_s": wall["s"], "busy_s": busy, "busy_fraction": busy / wall["s"] if wall["s"] else None,
            "kernels": kernels, "seconds_by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1]))}


def host_syncs(trainer, device) -> int | None:
    """Synchronising calls in one step (CUDA's sync debug mode warns once per sync)."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchron" in str(w.message).lower() for w in caught)


def ring_attention(device, seq: int, heads: int = 16, kv_heads: int = 8, dim: int = 128, cp: int = 2) -> dict:
    """One CP rank's ring blocks (forward + backward) against the whole sequence in one fused call."""
    from workers.parallel.attention_kernel import attention_backward, attention_forward, backward_blocks, forward_blocks
    from workers.parallel.context_layout import cp_positions
    from workers.parallel.context_ring import ring_plans

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    full_q = torch.randn(seq, 1, heads, dim, generator=g).to(device, dtype)
    full_k = torch.randn(seq, 1, kv_heads, dim, generator=g).to(device, dtype)
    full_v = torch.randn(seq, 1, kv_heads, dim, generator=g).to(device, dtype)
    scale = dim ** -0.5
    bhsd = lambda x: x.permute(1, 2, 0, 3)  # noqa: E731

    _peak_reset(device)
    with _timed() as whole:
        out, lse = attention_forward(bhsd(full_q), bhsd(full_k), bhsd(full_v), causal=True, scale=scale)
        attention_backward(torch.ones_like(out), bhsd(full_q), bhsd(full_k), bhsd(full_v), out, lse, causal=True,
                           scale=scale)
    whole_peak = _peak_gib(device)

    rank = 0
    pos = [cp_positions(seq, cp, r, device=device) for r in range(cp)]
    q = full_q[pos[rank]]
    plans = ring_plans(seq, cp, rank)
    _peak_reset(device)
    with _timed() as ring:
        acc = torch.zeros(q.shape, dtype=torch.float32, device=device)
        lse = torch.full((1, heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=device)
        for step in range(cp):
            src = pos[(rank - step) % cp]
            forward_blocks(q, full_k[src], full_v[src], plans[step], scale, acc, lse)
        o = acc.to(dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
        for step in range(cp):
            src = pos[(rank - step) % cp]
            dk = torch.zeros(full_k[src].shape, dtype=torch.float32, device=device)
            dv = torch.zeros_like(dk)
            backward_blocks(torch.ones_like(o), q, full_k[src], full_v[src], o, lse, plans[step], scale, dq, dk, dv)
    return {"seq": seq, "cp": cp, "dtype": str(dtype).replace("torch.", ""), "whole_s": whole["s"],
            "ring_rank_s": ring["s"], "ring_over_half_whole": ring["s"] / (whole["s"] / 2),
            "whole_peak_gib": whole_peak, "ring_rank_peak_gib": _peak_gib(device)}


def moe_gemm(device, tokens: int, hidden: int, ffn: int, experts: int = 8, topk: int = 2) -> dict:
    """The SwiGLU experts of one MoE layer, forward and backward: the product's grouped GEMM
    (:func:`workers.parallel.grouped_gemm.swiglu_experts`: ``torch._grouped_mm`` where the device
    has it, one padded bmm otherwise) against the per-expert loop it replaced (bench/moe_bench.py)."""
    from moe_bench import loop_swiglu_experts
    from workers.parallel.grouped_gemm import ExpertRuns, grouped_mm_supported, swiglu_experts

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    counts = torch.multinomial(torch.ones(experts), tokens * topk, replacement=True, generator=g).bincount(
        minlength=experts)
    runs = ExpertRuns(counts.tolist(), counts.to(device))
    x = torch.randn(tokens * topk, hidden, generator=g).to(device, dtype).requires_grad_(True)
    w_gate, w_up = (torch.randn(experts, ffn, hidden, generator=g).to(device, dtype).requires_grad_(True)
                    for _ in range(2))
    w_down = torch.randn(experts, hidden, ffn, generator=g).to(device, dtype).requires_grad_(True)
    params = (x, w_gate, w_up, w_down)

    def step(fn):
        for p in params:
            p.grad = None
        y = fn(x, w_gate, w_up, w_down, runs)
        y.backward(torch.ones_like(y))
        return y.detach(), [p.grad for p in params]

    y_loop, g_loop = step(loop_swiglu_experts)
    y_grp, g_grp = step(swiglu_experts)
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()  # noqa: E731
    reps = 5
    with _timed() as t_loop:
        for _ in range(reps):
            step(loop_swiglu_experts)
    with _timed() as t_grouped:
        for _ in range(reps):
            step(swiglu_experts)
    return {"tokens": tokens, "experts": experts, "topk": topk, "dtype": str(dtype).replace("torch.", ""),
            "kernel": "torch._grouped_mm" if grouped_mm_supported(x, w_gate, w_up, w_down) else "padded bmm",
            "loop_s": t_loop["s"] / reps, "grouped_s": t_grouped["s"] / reps, "speedup": t_loop["s"] / t_grouped["s"],
            "max_rel_error": max(rel(y_grp, y_loop), *(rel(a, b) for a, b in zip(g_grp, g_loop)))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file (default $OUT/gpu_suite.json, else ./gpu_suite.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: every section runs, nothing is measured")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_suite: no CUDA device; nothing measured (--smoke runs a tiny CPU version)")
        return 0
    device = torch.device("cuda", 0) if cuda and not args.smoke else torch.device("cpu")
    cfg = SMOKE if args.smoke else BENCH
    from service.spec.spec import parse_spec, to_job_config
    from workers.train.trainer import Trainer

    job = to_job_config(parse_spec(model_spec(argparse.Namespace(**cfg))))
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = PEAK_TFLOPS if device.type == "cuda" else {}
    report: dict = {"device": name, "torch": torch.__version__, "model": cfg, "peak_tflops": peak}
    t0 = time.perf_counter()

    def section(key: str, fn, *a, **kw):
        t = time.perf_counter()
        report[key] = fn(*a, **kw)
        print(f"{key} ({time.perf_counter() - t:.1f}s): {json.dumps(report[key], default=str)}", flush=True)

    section("steps", steps, job, device, cfg, peak)
    section("sdpa_backend", sdpa_backend, job, device)
    import dataclasses

    bf16 = dataclasses.replace(job, training=dataclasses.replace(job.training, bf16=device.type == "cuda"))
    trainer = Trainer(bf16, 0, 1, device=device)
    section("profile", profile_step, trainer, device)
    section("host_syncs", host_syncs, trainer, device)
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    section("ring_attention", ring_attention, device, 256 if args.smoke else 16384,
            **({"heads": 4, "kv_heads": 2, "dim": 16} if args.smoke else {}))
    section("moe_gemm", moe_gemm, device, 64 if args.smoke else 8192, 32 if args.smoke else 2048,
            64 if args.smoke else 1408)
    report["total_s"] = time.perf_counter() - t0
    out = args.out or os.path.join(os.environ.get("OUT", "."), "gpu_suite.json")
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"gpu_suite: {report['total_s']:.0f}s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
