"""Zero-bubble pipelines in bf16/fp16 and FP8: the B/W split defers the weight-gradient GEMMs
there too, and the gradients are the unsplit backward's bit for bit.

Checked: the no-TP linear through its custom Function is ``F.linear`` bit for bit; a deferred
bf16/fp16 backward (each GEMM queued in B, run in W in microbatch order, a weight used by three
GEMMs summed as autograd sums them) fills the fp32 main-grad buffer with exactly the unsplit
backward's bits, and its hooks run at W; a tied table (lookup + GEMM in one backward) keeps its
GEMM in B; the whole model at pp 2 gives 1F1B's losses, grad norms, iteration-0 gradients and
final params bit for bit (ZB-H1), ZBV the same V layout's with its backwards unsplit, in bf16,
fp16 and FP8 (over bf16 and fp32, and through ``_scaled_mm``), and both agree with the single bf16 process within the bf16
tolerances.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from workers.parallel import wgrad
from workers.parallel.data import DataParallelGrads

_DTYPES = [torch.bfloat16, torch.float16]
_S, _B, _H, _L, _M = 3, 2, 8, 4, 3


@pytest.mark.parametrize("dtype", _DTYPES, ids=["bf16", "fp16"])
def test_low_precision_linear_function_is_f_linear_bit_for_bit(dtype):
    """With a ``main_grad`` (any dtype) ``wgrad.linear`` runs its custom Function: output,
    input gradient and weight gradient are ``F.linear``'s bits."""
    g = torch.Generator().manual_seed(5)
    x0, w0 = torch.randn(7, 3, 16, generator=g).to(dtype), (torch.randn(24, 16, generator=g) * 0.3).to(dtype)
    grad = torch.randn(7, 3, 24, generator=g).to(dtype)
    got, want = [], []
    for use_function, out in ((True, got), (False, want)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        if use_function:
            w.main_grad = torch.zeros(w.shape)  # an fp32 buffer view, as DataParallelGrads gives
        y = wgrad.linear(x, w) if use_function else F.linear(x, w)
        assert (y.grad_fn.name() == "LinearFusedWgradBackward") == use_function
        y.backward(grad)
        out += [y.detach(), x.grad, w.grad]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class _Layer(torch.nn.Module):
    """``tanh(W2 (W x) + b)``, or with ``thrice`` ``tanh(W (W (W x)) + b)`` (one weight, three
    GEMMs in one backward), through ``wgrad.linear``."""

    def __init__(self, g, dtype, thrice):
        super().__init__()
        self.weight = torch.nn.Parameter((torch.randn(_H, _H, generator=g) * 0.4).to(dtype))
        second = (torch.randn(_H, _H, generator=g) * 0.4).to(dtype)
        self.second = None if thrice else torch.nn.Parameter(second)
        self.bias = torch.nn.Parameter((torch.randn(_H, generator=g) * 0.1).to(dtype))

    def forward(self, x):
        h = wgrad.linear(x, self.weight)
        if self.second is None:
            h = wgrad.linear(h, self.weight)
        return torch.tanh(wgrad.linear(h, self.second if self.second is not None else self.weight) + self.bias)


def _run(dtype, defer):
    """The toy over ``_M`` microbatches on an fp32 main-grad buffer, the last one armed; with
    ``defer`` in ZB-H1's order (B0 B1 W0 B2 W1 W2). Returns the buffer, the queue lengths and
    the buckets launched before the last W."""
    g = torch.Generator().manual_seed(7)
    layers = [_Layer(g, dtype, thrice=i == 1) for i in range(_L)]
    params = [p for layer in layers for p in layer.parameters()]
    grads = DataParallelGrads([(params, None)], bucket_size=None, grad_dtype=torch.float32)
    grads.zero()
    lengths, pending, launched = [], [], None
    for mb in range(_M):
        x = (torch.randn(_S, _B, _H, generator=g) * 0.5).to(dtype)
        for layer in layers:
            x = layer(x)
        if mb == _M - 1:
            grads.arm(params)
        loss = (x.float() ** 2).mean()
        if not defer:
            loss.backward()
            continue
        with wgrad.deferred_wgrads() as queue:
            loss.backward()
        lengths.append(len(queue))
        if mb == 0:  # the weights' buffer is untouched, the biases' folded in at B
            assert all(float(p.main_grad.abs().sum()) == 0 for p in params if p.dim() == 2)
            assert all(float(l.bias.main_grad.abs().sum()) > 0 for l in layers)
        pending.append(queue)
        if mb >= 1:
            wgrad.run_wgrads(pending.pop(0))
    if defer:
        launched = grads.num_launched()
        wgrad.run_wgrads(pending.pop(0))
    assert grads.num_launched() == 1  # the armed bucket went out, at the last W when deferred
    grads.finish()
    flat = grads.buffers[0].grad.clone()
    grads.remove_hooks()
    return flat, lengths, launched


@pytest.mark.parametrize("dtype", _DTYPES, ids=["bf16", "fp16"])
def test_deferred_low_precision_weight_gradients_are_bit_identical(dtype):
    """Every weight GEMM waits for W (two per layer, three for the weight used thrice), the
    biases' gradients are folded in at B, the armed bucket goes out at the last W, and the fp32
    buffer holds the unsplit backward's bits. Breaks if run_wgrads sums a weight's GEMMs in
    another order than autograd's, runs the microbatches' Ws out of order, or skips a GEMM."""
    want, _, _ = _run(dtype, defer=False)
    got, lengths, launched = _run(dtype, defer=True)
    assert lengths == [2 * _L + 1] * _M
    assert launched == 0
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_tied_table_keeps_its_gemm_in_b_in_low_precision():
    """A table used by a lookup and a GEMM in one backward (``zero_out_wgrad``): autograd sums
    the two in bf16 before the hook folds them, so a deferred GEMM would round differently; its
    GEMM runs in B and the gradient is the unsplit one's."""
    g = torch.Generator().manual_seed(3)
    table0 = torch.randn(11, _H, generator=g).bfloat16()
    tokens = torch.randint(0, 11, (_S, _B), generator=g)
    out = []
    for defer in (False, True):
        table = torch.nn.Parameter(table0.clone())
        table.zero_out_wgrad = True
        grads = DataParallelGrads([([table], None)], grad_dtype=torch.float32)
        grads.zero()
        logits = wgrad.linear(torch.tanh(F.embedding(tokens, table)), table)
        with wgrad.deferred_wgrads() if defer else contextlib.nullcontext([]) as queue:
            (logits.float() ** 2).mean().backward()
        assert queue == []
        grads.finish()
        out.append(grads.buffers[0].grad.clone())
        grads.remove_hooks()
    assert torch.equal(out[0], out[1]) and float(out[0].abs().sum()) > 0


# ----------------------------------------------------------------------------- the trainer

_PP2 = {"pipeline_model_parallel_size": 2}
_ZBV = {**_PP2, "virtual_pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv"}
_LAYOUTS = {  # name: (parallel, W deferred)
    "1f1b": ({**_PP2, "pipeline_schedule": "1f1b"}, True),
    "zb-h1": ({**_PP2, "pipeline_schedule": "zb-h1"}, True),
    "zbv": (_ZBV, True),
    "zbv-unsplit": (_ZBV, False),  # the same V table, each B a whole backward (W has nothing to run)
}
_PRECISIONS = {"bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 2.0**10},
               "fp8-bf16": {"bf16": True, "fp8": "hybrid"}, "fp8-fp32": {"fp8": "e4m3"},
               "fp8-scaled_mm": {"bf16": True, "fp8": "hybrid", "fp8_gemm": "scaled_mm"}}
_SAME = ("loss", "grad_norm", "mtp_loss", "loss_scale", "skipped", "val_loss")


def _trainer_runs(rank, world_size, jobs):
    """:func:`tests.helpers.parity.run_trainer` of each ``(job, defer)``, with the GEMMs the
    executor's W steps ran counted (``defer`` False: its Bs run whole backwards)."""
    from tests.helpers.parity import run_trainer
    from workers.parallel import pipeline_exec

    results, run_wgrads, deferred_wgrads = [], pipeline_exec.run_wgrads, pipeline_exec.deferred_wgrads
    for job, defer in jobs:
        counted = []
        pipeline_exec.run_wgrads = lambda queue: (counted.append(len(queue)), run_wgrads(queue))
        if not defer:
            pipeline_exec.deferred_wgrads = lambda: contextlib.nullcontext([])
        try:
            results.append({**run_trainer(rank, world_size, job), "w_gemms": sum(counted), "w_steps": len(counted)})
        finally:
            pipeline_exec.run_wgrads, pipeline_exec.deferred_wgrads = run_wgrads, deferred_wgrads
    return results


@pytest.fixture(scope="module")
def lowp_runs():
    """Every layout of ``_LAYOUTS`` in every precision, on 2 ranks: ``{(precision, layout): per_rank}``."""
    from tests.helpers.parity import job_of, tiny_spec
    from tests.helpers.ranks import run_ranks

    keys = [(p, name) for p in _PRECISIONS for name in _LAYOUTS]
    jobs = [(job_of(tiny_spec(world=2, parallel=_LAYOUTS[name][0], training=_PRECISIONS[p])), _LAYOUTS[name][1])
            for p, name in keys]
    per_rank = run_ranks(_trainer_runs, 2, args=(jobs,), timeout_s=600)
    return {key: [r[i] for r in per_rank] for i, key in enumerate(keys)}


def _assert_bit_identical(got: list[dict], want: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(got, want)):
        for key in _SAME:
            assert [m[key] for m in a["metrics"]] == [m[key] for m in b["metrics"]], (rank, key)
        for what in ("grads", "params"):
            assert sorted(a[what]) == sorted(b[what])
            for name, value in a[what].items():
                assert value.tobytes() == b[what][name].tobytes(), f"rank {rank}: {what} of {name} differ"


@pytest.mark.slow
@pytest.mark.parametrize("precision", list(_PRECISIONS))
@pytest.mark.parametrize("name, baseline", [("zb-h1", "1f1b"), ("zbv", "zbv-unsplit")])
def test_low_precision_zero_bubble_is_its_unsplit_schedule_bit_for_bit(lowp_runs, precision, name, baseline):
    """ZB-H1 at pp 2 gives 1F1B's losses, grad norms, iteration-0 gradients and final params bit
    for bit, ZBV its own V layout's with whole backwards; with the W steps running the linears'
    weight-gradient GEMMs (the baselines' W steps run none; under FP8 the GEMMs of the
    dequantised weight copies, handed back in the parameter's dtype as the cast does)."""
    got, want = lowp_runs[(precision, name)], lowp_runs[(precision, baseline)]
    _assert_bit_identical(got, want)
    for a, b in zip(got, want):
        assert a["w_steps"] > 0 and a["w_gemms"] >= 4 * a["w_steps"], a["w_gemms"]  # 4 linears a layer
        assert b["w_gemms"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_bf16_zero_bubble_agrees_with_the_single_bf16_process(lowp_runs, name):
    """Within the bf16 tolerances every layout is held to (losses, gradients, grad norms)."""
    from tests.helpers.layouts import BF16, BF16_TOL
    from tests.helpers.parity import check_results

    check_results(lowp_runs[("bf16", name)], None, BF16, **BF16_TOL)


_TP_SP = {**_PP2, "tensor_model_parallel_size": 2, "sequence_parallel": True}
_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@pytest.mark.slow
def test_bf16_zero_bubble_with_tp_sp_and_recompute_is_1f1b_bit_for_bit():
    """The column/row-parallel linears' own backwards (SP: the input gathered again in B) defer
    their GEMMs too, inside recomputed layers: ZB-H1 at tp 2 (SP) x pp 2 with full recompute
    gives 1F1B's bits."""
    from tests.helpers.parity import job_of, tiny_spec
    from tests.helpers.ranks import run_ranks

    jobs = [(job_of(tiny_spec(world=4, parallel={**_TP_SP, "pipeline_schedule": name}, model=_RECOMPUTE,
                              training=_PRECISIONS["bf16"])), True) for name in ("zb-h1", "1f1b")]
    per_rank = run_ranks(_trainer_runs, 4, args=(jobs,), timeout_s=600)
    got, want = [r[0] for r in per_rank], [r[1] for r in per_rank]
    _assert_bit_identical(got, want)
    assert all(a["w_gemms"] >= 4 * a["w_steps"] > 0 for a in got)
