"""The attention blocks' formula path (workers/parallel/attention_kernel.py: ``math_forward``,
``math_backward``), which runs float64 blocks where the CUDA kernels take none: against the CPU
fused kernel in float64, causal and fully visible blocks, grouped-query heads (mutation: the
backward's ``rowsum(dO O)`` term dropped, or the causal mask a key too wide -> gradients off by ~3)."""

import pytest
import torch

from workers.parallel.attention_kernel import attention_backward, attention_forward, math_backward, math_forward


@pytest.mark.parametrize("causal", [True, False])
def test_the_formulas_match_the_fused_kernel_in_float64(causal):
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = attention_forward(q, k, v, causal=causal, scale=0.3)
    got_out, got_lse = math_forward(q, k, v, causal=causal, scale=0.3)
    torch.testing.assert_close(got_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, lse, rtol=1e-12, atol=1e-12)
    for got, want in zip(math_backward(dout, q, k, v, out, lse, causal=causal, scale=0.3),
                         attention_backward(dout, q, k, v, out, lse, causal=causal, scale=0.3)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
