"""Fused elementwise pieces of the decoder layer: RMSNorm, rotary embedding of q and k, SwiGLU.

Each is a ``torch.autograd.Function`` whose forward and backward are a handful of aten ops
(measured with a dispatch counter, ``bench/step_bench.py``) and that saves only what its
backward needs, where autograd over the plain formulas dispatched ~4x the ops and saved fp32
intermediates (PERF_NOTES items 2 and 12). The math is the plain formulas'; only the rounding
order differs, and every layout runs the same code, so layouts agree with the single process
as before. These are written by hand rather than through ``torch.compile`` because compiling
on a CPU rank costs tens of seconds per layer shape and imports dynamo at start-up.
"""

from __future__ import annotations

import torch

from workers.parallel.wgrad import handed_to_main_grad, wide_owner


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 if it is a 16-bit float, else as it is (fp32 and fp64 stay)."""
    return t.float() if t.element_size() < 4 else t


class _RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight``; statistics in fp32. Saves the normalised input
    (fp32 runs; it replaces ``x``, which nothing else keeps) or ``x`` (bf16/fp16 runs: the fp32
    ``xhat`` would double the bytes), and the per-token ``rstd``. A weight with a float64
    ``main_grad`` (:func:`workers.parallel.wgrad.wide_owner`, kept on ``ctx``: a recomputed
    region's saved weight comes back without its attributes) gets ``sum(g xhat)`` in float64,
    added into the buffer: the products exact, the sum the single process's however a layout
    cuts the tokens."""

    @staticmethod
    def forward(ctx, x, weight, eps, owner):
        ctx.owner = owner
        xf = _wide(x)
        h = x.shape[-1]
        # rstd = (|x|^2 / h + eps)^-1/2 from one norm reduction (3 ops where mean(x^2) takes 4).
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        eps = eps if isinstance(eps, torch.Tensor) else torch.full((), eps, dtype=norm.dtype, device=norm.device)
        rstd = torch.addcmul(eps, norm, norm, value=1.0 / h).rsqrt_()
        xhat = xf * rstd
        fp32 = xf is x
        ctx.save_for_backward(xhat if fp32 else x, weight, rstd)
        ctx.fp32 = fp32
        return xhat.to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        saved, weight, rstd = ctx.saved_tensors
        xhat = saved if ctx.fp32 else _wide(saved) * rstd
        h = xhat.shape[-1]
        # No CPU kernel for aten._fused_rms_norm_backward (CUDA has one): the textbook
        # backward in fp32, dx = rstd * (g w - xhat * mean(g w xhat)), dw = sum(g xhat).
        if ctx.owner is not None and not torch.is_grad_enabled():
            gw = grad * weight if ctx.fp32 else (grad * weight).float()
            ctx.owner.main_grad.add_((grad.double() * xhat.double()).reshape(-1, h).sum(0))
            dw = handed_to_main_grad(ctx.owner)
        elif ctx.fp32:
            gw = grad * weight
            dw = (grad * xhat).reshape(-1, h).sum(0)
        else:
            # The products with the weight in 16 bits, as autograd over the plain formula
            # rounds them: layouts that split the tokens (SP) then round as the single process
            # does (an fp32 dw rounded per TP rank flipped MoE routing in bf16 parity).
            gw = (grad * weight).float()
            dw = (grad * xhat.to(grad.dtype)).reshape(-1, h).sum(0)
        flat_gw, flat_xhat = gw.reshape(-1, 1, h), xhat.reshape(-1, h, 1)
        dot = torch.bmm(flat_gw, flat_xhat).view(*xhat.shape[:-1], 1)  # per-token sum(g w xhat), one op
        dx = torch.addcmul(gw, xhat, dot, value=-1.0 / h).mul_(rstd)
        return dx.to(saved.dtype), dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps) -> torch.Tensor:
    """RMSNorm over the last dim (Llama's): four forward ops and six backward ops.

    Args:
        eps: a float, or a 0-dim fp32 tensor (saves making one per call).
    """
    return _RMSNorm.apply(x, weight, eps, wide_owner(weight))


def rotary_qkv_tables(rotary: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Broadcastable tables that rotate the q and k slots of a ``[s, b, groups, slots, d]`` QKV
    block in one pass and leave its last slot (v) as it is.

    Args:
        rotary: :func:`workers.model.decoder.rotary_tables` output, ``[2, s, 1, 1, d / 2]`` (cos, sin).
        slots: q heads per group + 2 (k, v).

    Returns:
        ``(cos, sin, sin_back)``, each ``[s, 1, 1, slots, d]``: rotate-half RoPE is
        ``x * cos + swap_halves(x) * sin`` with ``cos = [c, c]`` and ``sin = [-s, s]``; its
        transpose (the backward) uses ``sin_back = -sin``. The v slot has cos 1, sin 0.
    """
    cos, sin = rotary[0], rotary[1]
    cos_full = torch.cat([cos, cos], dim=-1).unsqueeze(-2)  # [s, 1, 1, 1, d]
    sin_full = torch.cat([-sin, sin], dim=-1).unsqueeze(-2)
    shape = (*cos_full.shape[:3], slots, cos_full.shape[-1])
    cos_t = cos_full.expand(shape).clone()
    sin_t = sin_full.expand(shape).clone()
    cos_t[..., -1, :] = 1.0
    sin_t[..., -1, :] = 0.0
    return cos_t, sin_t, -sin_t


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """``[x2, x1]`` from ``[x1, x2]`` along the last dim: one ``roll`` (on CPU 2x faster than
    flipping the halves, measured)."""
    return torch.roll(x, x.shape[-1] // 2, -1)


class _RotaryQKV(torch.autograd.Function):
    """RoPE on q and k and the q / k / v split of a fused QKV output, as one node.

    Forward rotates the whole ``[s, b, groups, slots, d]`` block (the v slot by the identity):
    three ops instead of seven per tensor, and no slice/select backward zero-fills: backward
    is three ops plus one ``cat`` of the q, k, v grads. Saves nothing but the tables.
    """

    @staticmethod
    def forward(ctx, qkv, cos, sin, sin_back):
        ctx.save_for_backward(cos, sin_back)
        out = torch.mul(qkv, cos).addcmul_(_swap_halves(qkv), sin)
        s, b, groups, slots, d = out.shape
        q = out[:, :, :, : slots - 2].reshape(s, b, groups * (slots - 2), d)
        return q, out[:, :, :, slots - 2], out[:, :, :, slots - 1]

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin_back = ctx.saved_tensors
        s, b, groups, slots, d = cos.shape[0], grad_k.shape[1], grad_k.shape[2], cos.shape[3], grad_k.shape[3]
        grad = torch.cat([grad_q.reshape(s, b, groups, slots - 2, d), grad_k.unsqueeze(3), grad_v.unsqueeze(3)], dim=3)
        swapped = _swap_halves(grad)
        return grad.mul_(cos).addcmul_(swapped, sin_back), None, None, None


def rotary_qkv(qkv: torch.Tensor, tables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [s, b, groups * per_group, d], k, v [s, b, groups, d])`` with RoPE applied to q, k.

    Args:
        qkv: ``[s, b, groups, per_group + 2, d]``, a view of the QKV projection's output.
        tables: :func:`rotary_qkv_tables` for ``per_group + 2`` slots.
    """
    return _RotaryQKV.apply(qkv, *tables)


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` from the fused ``[..., gate | up]`` output; saves that input only."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        # silu of the strided gate half into a dense buffer: F.silu(gate) keeps the input's
        # strides and took 3x as long on CPU (measured).
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        return torch.ops.aten.silu.out(gate, out=out).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.empty_like(gate_up)
        grad_gate, grad_up = out.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.ops.aten.silu.out(gate, out=grad_up).mul_(grad)
        return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a ``[..., 2 f]`` tensor laid out ``[gate | up]`` (this TP rank's halves)."""
    return _SwiGLU.apply(gate_up)
