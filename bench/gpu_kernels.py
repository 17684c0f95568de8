"""The GPU suite's kernel sections: one CP rank's ring-attention blocks against the fused kernel, and the grouped MoE expert GEMMs against the per-expert loop.

Each runs forward and backward on one device and returns its figures as a dict
(:mod:`bench.gpu_suite` writes them under ``ring_attention`` and ``moe_gemm``), with the timing
and peak-memory helpers the suite's other sections share.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


@contextmanager
def timed():
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    box = {"t0": time.perf_counter()}
    yield box
    sync()
    box["s"] = time.perf_counter() - box["t0"]


def peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


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

    peak_reset(device)
    with timed() as whole:
        out, lse = attention_forward(bhsd(full_q), bhsd(full_k), bhsd(full_v), causal=True, scale=scale)
        attention_backward(torch.ones_like(out), bhsd(full_q), bhsd(full_k), bhsd(full_v), out, lse, causal=True,
                           scale=scale)
    whole_peak = peak_gib(device)

    rank = 0
    pos = [cp_positions(seq, cp, r, device=device) for r in range(cp)]
    q = full_q[pos[rank]]
    plans = ring_plans(seq, cp, rank)
    peak_reset(device)
    with timed() as ring:
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
            "whole_peak_gib": whole_peak, "ring_rank_peak_gib": peak_gib(device)}


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
    with timed() as t_loop:
        for _ in range(reps):
            step(loop_swiglu_experts)
    with timed() as t_grouped:
        for _ in range(reps):
            step(swiglu_experts)
    return {"tokens": tokens, "experts": experts, "topk": topk, "dtype": str(dtype).replace("torch.", ""),
            "kernel": "torch._grouped_mm" if grouped_mm_supported(x, w_gate, w_up, w_down) else "padded bmm",
            "loop_s": t_loop["s"] / reps, "grouped_s": t_grouped["s"] / reps, "speedup": t_loop["s"] / t_grouped["s"],
            "max_rel_error": max(rel(y_grp, y_loop), *(rel(a, b) for a, b in zip(g_grp, g_loop)))}
