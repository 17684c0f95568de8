"""The fused decoder pieces (workers.model.fused), the vocab-parallel cross-entropy and the flat fused
AdamW against their plain formulas, forward and backward, and the op budget of a layer.

The parity suites compare layouts with a single process that runs the same fused code, so a
symmetric mistake there would pass them; these tests hold each piece to an independent
reference (plain autograd in float64, ``F.cross_entropy``, ``torch.optim.AdamW``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.model.fused import rms_norm, rotary_qkv, rotary_qkv_tables, swiglu
from workers.model.decoder import rotary_tables
from workers.parallel.cross_entropy import vocab_parallel_cross_entropy


def _grads(fn, inputs, seed):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    return outs, torch.autograd.grad(outs, inputs, seed)


def _check(fused, plain, inputs, rtol=1e-10):
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref_outs = plain(*inputs64)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    seeds = [torch.randn_like(o) for o in ref_outs]
    ref_grads = torch.autograd.grad(ref_outs, inputs64, seeds)
    got_outs, got_grads = _grads(fused, [t.detach().double().requires_grad_() for t in inputs], seeds)
    for got, want in zip(got_outs + got_grads, ref_outs + ref_grads):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)


def test_rms_norm_matches_the_plain_formula():
    torch.manual_seed(0)
    x, w = torch.randn(6, 3, 16), torch.rand(16) + 0.5
    _check(lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w,
           [x, w])


def test_rms_norm_in_bf16_keeps_fp32_statistics():
    torch.manual_seed(0)
    x, w = torch.randn(6, 3, 16), torch.rand(16) + 0.5
    want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16() * w.bfloat16()
    got = rms_norm(x.bfloat16(), w.bfloat16(), 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_swiglu_matches_the_plain_formula():
    torch.manual_seed(0)
    _check(swiglu, lambda t: F.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1], [torch.randn(5, 2, 12)])


def _rotate_half(x, rotary):
    cos, sin = rotary[0], rotary[1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_rotary_qkv_matches_rotate_half_per_tensor():
    torch.manual_seed(0)
    s, b, groups, per, d = 8, 2, 2, 3, 8
    rotary = rotary_tables(torch.arange(s), d, 10000.0).double()

    def plain(qkv):
        q = qkv[:, :, :, :per].reshape(s, b, groups * per, d)
        return _rotate_half(q, rotary), _rotate_half(qkv[:, :, :, per], rotary), qkv[:, :, :, per + 1]

    tables = rotary_qkv_tables(rotary, per + 2)
    _check(lambda qkv: rotary_qkv(qkv, tables), plain, [torch.randn(s, b, groups, per + 2, d)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_torch_and_keeps_the_logits_dtype(dtype):
    torch.manual_seed(0)
    logits = torch.randn(7, 3, 20).to(dtype).requires_grad_()
    target = torch.randint(0, 20, (7, 3))
    ref_logits = logits.detach().double().requires_grad_()
    want = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction="none").view(7, 3)
    got = vocab_parallel_cross_entropy(logits, target, None)
    assert got.dtype == torch.float32
    seed = torch.rand(7, 3)
    (want_grad,) = torch.autograd.grad(want, ref_logits, seed.double())
    (got_grad,) = torch.autograd.grad(got, logits, seed)
    assert got_grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_grad.double(), want_grad, rtol=tol, atol=tol)


def test_decoder_layer_dispatches_at_most_60_kernels():
    from bench.step_bench import ops_per_layer, step_job

    job = step_job(model={"hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                          "ffn_hidden_size": 64, "seq_length": 16}, training={"micro_batch_size": 2})
    assert ops_per_layer(job) <= 60
