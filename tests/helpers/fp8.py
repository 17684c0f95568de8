"""FP8 linears run both ways, emulated and through ``torch._scaled_mm`` (workers/parallel/fp8_gemm.py):
the operands, the runs and the exact-operand equality that tests/workers/parallel/test_fp8_gemm.py
checks on CPU and tests/test_gpu.py on CUDA."""

from __future__ import annotations

import torch

from workers.parallel.fp8 import E4M3, Fp8Recipe, LinearFp8, update_delayed_scales
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def operands(exact: bool, grad_dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """A weight ``[48, 32]``, an input ``[8, 2, 32]`` and an output gradient ``[8, 2, 48]`` (16
    tokens: every dim a multiple of 16). ``exact``: integers scaled so each amax is 7 / 2^k and
    every scale a power of two (e4m3 448 / 7 = 64, e5m2 57344 / 7 = 8192), each its own, so a
    scale used for the wrong operand shows; the FP8 casts, the products and the sums are exact."""
    g = torch.Generator().manual_seed(0)
    if not exact:
        return tuple(t.to(device) for t in (torch.randn(48, 32, generator=g) * 0.05, torch.randn(8, 2, 32, generator=g),
                                             torch.randn(8, 2, 48, generator=g) * 1e-3))
    out = []
    for shape, unit in (((48, 32), 0.5), ((8, 2, 32), 1.0), ((8, 2, 48), 4.0 if grad_dtype == E4M3 else 0.25)):
        t = torch.randint(-7, 8, shape, generator=g).float()
        t.view(-1)[0] = 7  # the amax
        out.append(t * unit)
    return tuple(t.to(device) for t in out)


def linear_runs(cls, fp8: str, recipe: str, dtype: torch.dtype, exact: bool, device="cpu") -> dict:
    """``{gemm: [(output, input gradient, weight gradient)] per iteration}``: two iterations
    (delayed: the second scales from the first's amax history) of one linear, emulated and
    through ``_scaled_mm``."""
    r = Fp8Recipe(fp8=fp8, recipe=recipe)
    w, x, dy = operands(exact, r.grad_dtype, device)
    runs = {}
    for gemm in ("emulated", "scaled_mm"):
        layer = cls(w, None).to(device=device, dtype=dtype)
        layer.fp8 = LinearFp8(Fp8Recipe(fp8=fp8, recipe=recipe, gemm=gemm), None)
        runs[gemm] = []
        for it in range(2):
            xi = (x * (it + 1)).to(dtype).requires_grad_()
            layer.weight.grad = None
            y = layer(xi)
            y.backward(dy.to(dtype))
            runs[gemm].append((y.detach(), xi.grad, layer.weight.grad))
            update_delayed_scales([layer], None)
    return runs


def assert_scaled_mm_is_emulated_on_exact_operands(device="cpu") -> None:
    """Every recipe and format, fp32 and bf16, column and row linear: bit for bit."""
    for cls in (ColumnParallelLinear, RowParallelLinear):
        for fp8 in ("hybrid", "e4m3"):
            for recipe in ("tensorwise", "delayed"):
                for dtype in (torch.float32, torch.bfloat16):
                    runs = linear_runs(cls, fp8, recipe, dtype, exact=True, device=device)
                    for it, (emulated, scaled) in enumerate(zip(runs["emulated"], runs["scaled_mm"])):
                        for what, a, b in zip(("output", "input gradient", "weight gradient"), emulated, scaled):
                            assert a.dtype == b.dtype == dtype and torch.equal(a, b), (
                                f"{cls.__name__} {fp8} {recipe} {dtype} iteration {it} {what}: "
                                f"max diff {(a.float() - b.float()).abs().max()}")
