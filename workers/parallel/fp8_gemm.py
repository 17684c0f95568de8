"""The FP8 linears' GEMMs (``training.fp8_gemm``): ``torch._scaled_mm`` on FP8 operands, or the
linears' own GEMMs on dequantised operands (emulated).

``training.fp8_gemm`` picks, per rank (:func:`workers.parallel.fp8.gemm_mode`): ``scaled_mm``,
``emulated``, or ``auto``: ``scaled_mm`` on a CUDA device with FP8 tensor cores (compute
capability 8.9 or newer) and the ``tensorwise`` or ``delayed`` recipe, ``emulated`` otherwise
(CPU, older GPUs, ``blockwise``). ``blockwise`` stays emulated: ``torch._scaled_mm`` takes one
scale per tensor (or per row), not DeepSeek's 1 x B / B x B tiles.

With ``scaled_mm`` the three GEMMs of ``y = x @ W.T`` are

* forward ``y = x W^T``: ``_scaled_mm(xq, wq.t())``, both e4m3;
* input gradient ``dx = dy W``: ``_scaled_mm(dyq, wq)``, the weight as a column-major copy;
* weight gradient ``dW = dy^T x``: ``_scaled_mm(dyq.t(), xq)``, the gradient's transpose as a
  row-major copy and the input as a column-major one;

``dyq`` e5m2 (``hybrid``) or e4m3 (``e4m3``): e5m2 x e4m3 and e4m3 x e4m3 are the pairs
cuBLASLt takes. The first operand is row-major, the second column-major (cuBLASLt's rule, and
torch's on CUDA, with every dim a multiple of 16: the spec checks the model's dims and
tokens). ``scale_a`` / ``scale_b`` are the operands' reciprocal scales (``_scaled_mm``
multiplies by them), the output fp32 as the emulated GEMM's, then cast to the compute dtype
where the emulated path casts it. The operands and scales are the emulated path's:
:func:`workers.parallel.fp8.quantize_operands` computes the per-tensor scales (the same amax
reductions, the same delayed-scaling bookkeeping), the linear carries its input and weight
through its collectives in the compute dtype and each GEMM casts them to FP8 with those scales
(the same elementwise cast on the same values: the bits of the emulated path), and the output
gradient is quantised once, at the GEMM output, for both backward GEMMs
(:class:`workers.parallel.fp8.ScaledGemm` holds it).

What differs from the emulated GEMMs, to the bit: the emulated GEMM sums ``(qa / sa) (qb / sb)``
(each quotient rounded to fp32) in the fp32 GEMM's order; ``_scaled_mm`` sums the exact products
``qa qb`` in its own order and then multiplies by ``(1/sa) (1/sb)``. Where the scales are powers
of two and the sums exact the two agree bit for bit (``tests/workers/parallel/test_fp8_gemm.py``
checks both the exact case and the bound of the rounded one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.parallel.fp8 import E4M3, ScaledGemm, quantize

def _mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """``(a / scale_a) @ (b / scale_b)`` in fp32 from FP8 ``a`` (row-major) and ``b`` (column-major)."""
    return torch._scaled_mm(a, b, scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(), out_dtype=torch.float32)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def forward(x: torch.Tensor, weight: torch.Tensor, gemm: ScaledGemm | None) -> torch.Tensor:
    """``x @ W.T``: ``F.linear`` (``gemm`` None), else ``_scaled_mm`` on the FP8 casts."""
    if gemm is None:
        return F.linear(x, weight)
    x_2d = x.reshape(-1, x.shape[-1])
    y = _mm(quantize(x_2d, gemm.x_scale, E4M3), gemm.w.t(), gemm.x_scale, gemm.w_scale)
    return y.view(*x.shape[:-1], y.shape[-1])


def dgrad(grad: torch.Tensor, weight: torch.Tensor, gemm: ScaledGemm | None) -> torch.Tensor:
    """``dy @ W``: the input gradient (``gemm``: from the quantised output gradient it holds)."""
    if gemm is None:
        return grad.matmul(weight)
    g, g_scale = gemm.grad
    out = _mm(g.reshape(-1, g.shape[-1]), _column_major(gemm.w), g_scale, gemm.w_scale)
    return out.view(*grad.shape[:-1], out.shape[-1])


def wgrad(grad_2d: torch.Tensor, x_2d: torch.Tensor, gemm: ScaledGemm | None) -> torch.Tensor:
    """``dy^T @ x`` over every token: the weight gradient."""
    if gemm is None:
        return grad_2d.t().matmul(x_2d)
    g, g_scale = gemm.grad
    g_t = g.reshape(-1, g.shape[-1]).t().contiguous()
    return _mm(g_t, _column_major(quantize(x_2d, gemm.x_scale, E4M3)), g_scale, gemm.x_scale)


def wgrad_wide(grad_2d: torch.Tensor, x_2d: torch.Tensor, gemm: ScaledGemm, dtype: torch.dtype) -> torch.Tensor:
    """:func:`wgrad`'s value in ``dtype`` (float64, ``main_grads_dtype: fp64``): the FP8 bits'
    GEMM in ``dtype``, every product of two FP8 values exact, then times the two reciprocal
    scales ``_scaled_mm`` multiplies by; the same to ~1e-16 however a layout cuts the tokens."""
    g, g_scale = gemm.grad
    a = g.reshape(-1, g.shape[-1]).to(dtype)
    b = quantize(x_2d, gemm.x_scale, E4M3).to(dtype)
    return (a.t() @ b).mul_(g_scale.reciprocal().to(dtype) * gemm.x_scale.reciprocal().to(dtype))
