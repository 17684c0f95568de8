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


import torch  # noqa: E402

from service.spec.cost import megatron_flops  # noqa: E402
from service.spec.shapes import Shapes  # noqa: E402
from bench.gpu_kernels import moe_gemm, ring_attention, timed  # noqa: E402
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
    """Training FLOPs per token of a dense model config by Megatron's formula, as the cost model
    counts them (:func:`service.spec.cost.megatron_flops`: causal attention halved)."""
    s = Shapes(m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size,
               m.vocab_size, m.seq_length, None, m.moe_router_topk, kv_channels=m.kv_channels)
    return megatron_flops(s, 1) / m.seq_length


def classify(name: str) -> str:
    low = name.lower()
    for cls, needles in KERNEL_CLASSES:
        if any(n in low for n in needles):
            return cls
    return "other"


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
    with timed() as wall, profile(activities=activities) as prof:
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
