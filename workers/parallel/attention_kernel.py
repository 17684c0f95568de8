"""Fused attention kernels that return the log-sum-exp, and blockwise attention merged by it.

Context parallelism computes a rank's attention as several blocks (ring steps, or the causal
and fully visible pieces of :func:`workers.parallel.context_layout.attention_blocks`). Each
block runs through torch's fused flash kernel, which never materialises a score block and
returns the row log-sum-exp; the blocks' normalised outputs are merged by it (online
softmax). Backward runs the kernel's own backward per block with the *merged* output and
log-sum-exp (FlashAttention's recipe), which makes every block's gradient exact.

The kernel is chosen by device, the same code otherwise (as torch's experimental
``context_parallel``):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``; it takes fewer K/V heads than
  query heads (grouped-query attention) directly.
* CUDA: ``aten._scaled_dot_product_flash_attention`` for fp16/bf16 and
  ``aten._scaled_dot_product_efficient_attention`` for fp32 (flash has no fp32). Their GQA
  support depends on the torch build, so K/V are repeated per block, inside the call only,
  and dK/dV summed back over each group. Not exercised on a GPU yet. Neither takes float64
  (``main_grads_dtype: fp64``): that runs the formulas (:func:`math_forward`,
  :func:`math_backward`), materialising the block's scores.

q/k/v stay in the compute dtype; only the merged output accumulator and the log-sum-exp are
fp32 (float64 for float64 q/k/v: :func:`acc_dtype`). Tensors are ``[b, heads, s, d]`` views (the callers' ``[s, b, heads, d]`` permuted; the
kernels take strides, so slicing a block costs no copy).
"""

from __future__ import annotations

from typing import Sequence

import torch

from workers.parallel.context_layout import Block

aten = torch.ops.aten


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the running output, log-sum-exp and gradient sums: fp32, or the inputs' own
    where wider (float64 q/k/v, ``main_grads_dtype: fp64``: the blocks merge to ~1e-16)."""
    return torch.promote_types(dtype, torch.float32)


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x if x.shape[1] == num_heads else x.repeat_interleave(num_heads // x.shape[1], dim=1)


def _sum_groups(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == num_kv_heads else grad.view(b, num_kv_heads, h // num_kv_heads, s, d).sum(2)


def attention_forward(q, k, v, *, causal: bool, scale: float):
    """One fused-kernel attention block.

    Args:
        q: ``[b, heads, s_q, d]``.
        k, v: ``[b, kv_heads, s_k, d]``.
        causal: top-left causal (``s_q == s_k`` here), else every key is visible.
        scale: multiplier of ``q . k``.

    Returns:
        ``(out [b, heads, s_q, d] in q's dtype, lse [b, heads, s_q] fp32)``.
    """
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(acc_dtype(q.dtype))
    if q.dtype == torch.float64:
        return math_forward(q, k, v, causal=causal, scale=scale)
    h = q.shape[1]
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    # The efficient kernel pads the log-sum-exp's sequence dim to a multiple of 32.
    return out, lse[..., : q.shape[2]].to(acc_dtype(q.dtype))


def attention_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    """dq, dk, dv of one block given the *merged* output and log-sum-exp of its query rows.

    With the global ``out`` and ``lse`` the kernel recomputes the block's probabilities as
    they are in the full softmax, so the block's gradients are its exact share.

    Returns:
        ``(dq [b, heads, s_q, d], dk, dv [b, kv_heads, s_k, d])`` in q's dtype.
    """
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if q.dtype == torch.float64:
        return math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    h, kv_heads, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    seed = torch.empty((), dtype=torch.int64, device=q.device)  # dropout is off: never read
    if q.dtype in (torch.float16, torch.bfloat16):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, sq, sk, 0.0, causal, seed, seed, scale=scale)
    else:
        padded = torch.nn.functional.pad(lse, (0, -sq % 32)).contiguous()
        dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)[:3]
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


def _probabilities(q, k, lse, causal: bool, scale: float) -> torch.Tensor:
    """``softmax(q k^T scale)`` of a block, normalised by ``lse`` (K already repeated per head)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if causal:  # top-left: query i sees keys 0..i
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if lse is None else lse
    return scores.sub_(lse[..., None]).exp_(), lse


def math_forward(q, k, v, *, causal: bool, scale: float):
    """:func:`attention_forward` by the formula (any dtype, any device)."""
    h = q.shape[1]
    p, lse = _probabilities(q, _repeat_kv(k, h), None, causal, scale)
    return torch.matmul(p, _repeat_kv(v, h)), lse


def math_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    """:func:`attention_backward` by the formula (FlashAttention's: ``dS = P (dP - rowsum(dO O))``)."""
    h, kv_heads = q.shape[1], k.shape[1]
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    p, _ = _probabilities(q, k, lse.to(q.dtype), causal, scale)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - (dout * out).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q).mul_(scale)
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def merge_block(acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold a block's normalised output into the running fp32 output, in place.

    Args:
        acc: running output rows ``[s_q, b, heads, d]`` (fp32).
        lse: their log-sum-exp ``[b, heads, s_q]`` (fp32, ``-inf`` before the first block).
        out: the block's output ``[b, heads, s_q, d]``.
        blk_lse: its log-sum-exp ``[b, heads, s_q]``.
    """
    new = torch.logaddexp(lse, blk_lse)
    # Each side is reweighted from its own softmax denominator to the joint one; against the
    # -inf start the block's weight is exactly 1 and the old one 0.
    w_old = torch.exp(lse - new).permute(2, 0, 1)[..., None]
    w_blk = torch.exp(blk_lse - new).permute(2, 0, 1)[..., None]
    acc.mul_(w_old).addcmul_(out.permute(2, 0, 1, 3), w_blk)  # no [s_q, b, heads, d] temporary
    lse.copy_(new)


def forward_blocks(q, k, v, blocks: Sequence[Block], scale: float, acc, lse) -> None:
    """Attend ``q [s_q, b, heads, d]`` to ``k, v [s_k, b, kv_heads, d]`` over ``blocks``, merging
    into ``acc [s_q, b, heads, d]`` and ``lse [b, heads, s_q]`` (both fp32)."""
    for blk in blocks:
        qi, ki = (blk.q, blk.b), (blk.k, blk.b)
        out, blk_lse = attention_forward(_bhsd(q[qi]), _bhsd(k[ki]), _bhsd(v[ki]), causal=blk.causal, scale=scale)
        merge_block(acc[qi], lse[blk.b, :, blk.q], out, blk_lse)


def backward_blocks(dout, q, k, v, out, lse, blocks: Sequence[Block], scale: float, dq, dk, dv) -> None:
    """Add the gradients of :func:`forward_blocks` to ``dq`` (like q) and ``dk``, ``dv`` (like k).

    ``out`` and ``lse`` are the final merged output (compute dtype) and log-sum-exp (fp32).
    """
    for blk in blocks:
        qi, ki = (blk.q, blk.b), (blk.k, blk.b)
        gq, gk, gv = attention_backward(
            _bhsd(dout[qi]), _bhsd(q[qi]), _bhsd(k[ki]), _bhsd(v[ki]), _bhsd(out[qi]),
            lse[blk.b, :, blk.q], causal=blk.causal, scale=scale)
        dq[qi] += gq.permute(2, 0, 1, 3)
        dk[ki] += gk.permute(2, 0, 1, 3)
        dv[ki] += gv.permute(2, 0, 1, 3)


class BlockAttention(torch.autograd.Function):
    """Local queries against local K/V (e.g. all-gathered) over mask-free ``blocks``."""

    @staticmethod
    def forward(ctx, q, k, v, blocks: Sequence[Block], scale: float):
        wide = acc_dtype(q.dtype)
        acc = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full((q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=wide, device=q.device)
        forward_blocks(q, k, v, blocks, scale, acc, lse)
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype(q.dtype), device=k.device)
        dv = torch.zeros_like(dk)
        backward_blocks(dout.contiguous(), q, k, v, out, lse, ctx.blocks, ctx.scale, dq, dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
