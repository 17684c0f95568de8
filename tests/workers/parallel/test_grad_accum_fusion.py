"""Gradient-accumulation fusion (workers.parallel.wgrad): in fp32 the parallel linears'
weight-gradient GEMMs accumulate into the data-parallel buffer's ``main_grad`` views.

Checked: over several microbatches no weight-sized gradient is computed apart from the buffer
(every weight-shaped GEMM is an in-place ``addmm_`` into the buffer, no weight-shaped add
follows) and the grads equal plain autograd's; a weight used twice in one backward (a tied
embedding) still gets both gradients; with data parallelism the buckets still go out during
the last microbatch's backward and reduce to the single-process gradients; the TP paths (with
and without SP) fuse too; modules outside a buffer, and bf16 params, keep plain autograd.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from workers.parallel import comm
from workers.parallel.data import DataParallelGrads
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from tests.helpers.ranks import run_ranks

S, B, H, FFN = 5, 3, 6, 10
NUM_MICRO = 3


class _Block(torch.nn.Module):
    """column (bias) -> gelu -> row (+ residual): both no-TP paths of the parallel linears."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = ColumnParallelLinear(torch.randn(FFN, H, generator=g) * 0.3, None,
                                       full_bias=torch.randn(FFN, generator=g) * 0.1)
        self.down = RowParallelLinear(torch.randn(H, FFN, generator=g) * 0.3, None)
        self.out = ColumnParallelLinear(torch.randn(4, H, generator=g) * 0.3, None)

    def forward(self, x):
        x = self.down(F.gelu(self.up(x)), residual=x)
        return self.out(x)


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(S, B, H, generator=g), torch.randn(S, B, 4, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    return ((model(x) - y) ** 2).sum() / (S * B * NUM_MICRO)


class _WeightShapedOps(TorchDispatchMode):
    """Records the ops whose output is shaped as one of ``shapes`` (2-D weights), by name,
    with whether the output is in place in ``storage`` (the flat gradient buffer)."""

    def __init__(self, shapes, storage):
        super().__init__()
        self.shapes, self.ptr, self.end = set(shapes), storage.data_ptr(), storage.data_ptr() + storage.nbytes
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            self.seen.append((func.overloadpacket.__name__, self.ptr <= out.data_ptr() < self.end))
        return out


# Views and bare allocations (the dummies): no pass over the memory.
_NO_KERNEL = {"view", "_unsafe_view", "alias", "detach", "t", "transpose", "as_strided", "slice", "empty",
              "empty_like", "empty_strided"}


def _reference_grads(batches):
    model = _Block()
    for x, y in batches:
        _loss(model, x, y).backward()
    return [p.grad for p in model.parameters()]


def test_weight_grads_accumulate_into_the_buffer_in_place():
    model = _Block()
    grads = DataParallelGrads([(model.parameters(), None)], bucket_size=None)
    buf = grads.buffers[0]
    weights = [model.up.weight, model.down.weight, model.out.weight]
    shapes = {tuple(w.shape) for w in weights}
    assert len(shapes) == 3  # no activation is shaped like a weight either (S*B = 15)
    batches = _batches(NUM_MICRO)
    for m, (x, y) in enumerate(batches):
        loss = _loss(model, x, y)
        with _WeightShapedOps(shapes, buf.grad) as ops:
            loss.backward()
        # One GEMM per weight, each an addmm_ into the buffer; nothing adds a fresh weight
        # gradient into it afterwards (only bare allocations: the dummies).
        kernels = [(name, inside) for name, inside in ops.seen if name not in _NO_KERNEL]
        assert sorted(kernels) == [("addmm_", True)] * 3, (m, ops.seen)
        for w in weights:
            assert w.grad.data_ptr() == buf.view(w).data_ptr()  # .grad is the buffer view again
            assert not w.grad_added_to_main_grad
    grads.finish()
    for p, want in zip(model.parameters(), _reference_grads(batches)):
        assert p.grad.data_ptr() == buf.view(p).data_ptr()
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-6)


def test_a_weight_used_twice_in_one_backward_gets_both_gradients():
    """A tied table (embedding lookup + output layer on one stage): the dummy is zeros and the
    hook adds the lookup's gradient (Megatron's zero_out_wgrad)."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(7, H, generator=g)
    tokens = [torch.randint(0, 7, (S, B), generator=g) for _ in range(NUM_MICRO)]

    def run(fuse):
        out = ColumnParallelLinear(table, None)
        out.weight.zero_out_wgrad = True
        grads = DataParallelGrads([([out.weight], None)]) if fuse else None
        for t in tokens:
            h = torch.tanh(F.embedding(t, out.weight))
            (out(h) ** 2).mean().backward()
        if grads is not None:
            grads.finish()
        return out.weight.grad

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=1e-6)


def test_plain_autograd_outside_a_buffer_and_in_bf16():
    model = _Block()
    x, y = _batches(1)[0]
    _loss(model, x, y).backward()
    assert all(not hasattr(p, "main_grad") for p in model.parameters())
    for p, want in zip(model.parameters(), _reference_grads([(x, y)])):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)
    # bf16 params over an fp32 buffer: the hook folds a low-precision .grad (no addmm_ of bf16).
    model = _Block()
    grads = DataParallelGrads([(model.parameters(), None)], grad_dtype=torch.float32)
    for p in model.parameters():  # as the optimizers' _cast_params
        p.data = p.data.to(torch.bfloat16)
        p.grad = None
    grads.buffers[0].main_grads = True
    _loss(model, x.bfloat16(), y.bfloat16()).float().backward()
    grads.finish()
    assert all(p.grad is None for p in model.parameters())
    assert grads.buffers[0].grad.abs().sum() > 0
    # remove_hooks detaches main_grad: the module is back to plain autograd.
    model = _Block()
    grads = DataParallelGrads([(model.parameters(), None)])
    grads.remove_hooks()
    _loss(model, x, y).backward()
    assert all(not hasattr(p, "main_grad") for p in model.parameters())
    for p, want in zip(model.parameters(), _reference_grads([(x, y)])):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-6)


def _dp_rank(rank, world):
    model = _Block()
    grads = DataParallelGrads([(model.parameters(), dist.group.WORLD)], bucket_size=20)
    batches = _batches(NUM_MICRO * world, seed=7)[rank::world]
    seen = []
    comm.reset_stats()
    for m, (x, y) in enumerate(batches):
        grads.set_last_microbatch(m == NUM_MICRO - 1)
        x = x.clone().requires_grad_(True)
        # The input's gradient comes last in backward: the later layers' buckets are out by then.
        x.register_hook(lambda g: seen.append(grads.num_launched()))
        _loss(model, x, y).backward()
    grads.finish()
    fused = [getattr(p, "grad_added_to_main_grad", None) for p in (model.up.weight, model.down.weight)]
    return {"grads": [p.grad.clone() for p in model.parameters()], "launched_at_input": seen,
            "num_buckets": grads.num_buckets(), "calls": sum(s["calls"] for s in comm.stats().values()),
            "fused": fused}


@pytest.mark.slow
def test_data_parallel_overlap_reduces_fused_grads():
    world = 2
    results = run_ranks(_dp_rank, world)
    ref = _reference_grads(_batches(NUM_MICRO * world, seed=7))
    for r in results:
        assert r["num_buckets"] >= 3
        assert r["fused"] == [False, False]  # the fused path ran (and the hook cleared the flag)
        assert r["launched_at_input"][:-1] == [0] * (NUM_MICRO - 1)
        assert r["launched_at_input"][-1] >= 1  # overlapped with the last backward
        assert r["calls"] == r["num_buckets"]  # one all-reduce per bucket per iteration
        for got, want in zip(r["grads"], ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _tp_rank(rank, world, sp):
    """column -> gelu -> row over a TP group of ``world`` (with or without SP), microbatches
    accumulated in a no-DP buffer: the TP autograd Functions' fused paths."""
    g = torch.Generator().manual_seed(5)
    w_up, w_down = torch.randn(FFN * 2, H, generator=g) * 0.3, torch.randn(H, FFN * 2, generator=g) * 0.3
    batches = [(torch.randn(S * 2, B, H, generator=g), torch.randn(S * 2, B, H, generator=g)) for _ in range(NUM_MICRO)]
    up = ColumnParallelLinear(w_up, dist.group.WORLD, sequence_parallel=sp)
    down = RowParallelLinear(w_down, dist.group.WORLD, sequence_parallel=sp)
    grads = DataParallelGrads([([up.weight, down.weight], None)])
    for x, target in batches:
        if sp:
            x, target = x.chunk(world)[rank], target.chunk(world)[rank]
        (down(F.gelu(up(x))) * target).sum().backward()
    grads.finish()
    fused = [getattr(w, "grad_added_to_main_grad", None) for w in (up.weight, down.weight)]
    return {"up": up.weight.grad.clone(), "down": down.weight.grad.clone(), "fused": fused,
            "ref": _tp_reference(w_up, w_down, batches)}


def _tp_reference(w_up, w_down, batches):
    w_up, w_down = w_up.clone().requires_grad_(), w_down.clone().requires_grad_()
    for x, target in batches:
        (F.linear(F.gelu(F.linear(x, w_up)), w_down) * target).sum().backward()
    return w_up.grad, w_down.grad


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_paths_fuse(sp):
    world = 2
    for rank, r in enumerate(run_ranks(_tp_rank, world, args=(sp,))):
        assert r["fused"] == [False, False]
        ref_up, ref_down = r["ref"]
        torch.testing.assert_close(r["up"], ref_up.chunk(world, 0)[rank], rtol=0, atol=1e-5)
        torch.testing.assert_close(r["down"], ref_down.chunk(world, 1)[rank], rtol=0, atol=1e-5)
