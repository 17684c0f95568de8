"""Data parallelism: bucketed overlapped grad reduction and the ZeRO-1 optimizer.

References are independent: plain autograd on the concatenated global batch, and
``torch.optim.AdamW`` on full params with the summed gradients.
"""

import collections
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from workers.parallel import comm
from workers.parallel.data import DataParallelGrads
from workers.parallel.optimizer import DistributedOptimizer, ReplicatedOptimizer, build_optimizer
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 8
NUM_MICRO = 2


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    )


def _batch(it):
    g = torch.Generator().manual_seed(100 + it)
    return torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _loss(model, x, y):
    # Scaled by the global batch so that the sum over ranks is the global-batch mean loss.
    return ((model(x) - y) ** 2).sum() / GLOBAL_BATCH


def _reference_grads(it):
    model = _model()
    x, y = _batch(it)
    _loss(model, x, y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _grads_rank(rank, world, overlap_flags):
    model = _model()
    grads = DataParallelGrads([(model.parameters(), dist.group.WORLD)], bucket_size=20)
    out = {"num_buckets": grads.num_buckets(), "grads": [], "calls": [], "launched_at_input": []}
    for it, overlap in enumerate(overlap_flags):
        grads.zero()
        x, y = _batch(it)
        per = GLOBAL_BATCH // world
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        comm.reset_stats()
        seen = []
        for m, (xm, ym) in enumerate(zip(xs.chunk(NUM_MICRO), ys.chunk(NUM_MICRO))):
            last = m == NUM_MICRO - 1
            grads.set_last_microbatch(last and overlap)
            xm = xm.clone().requires_grad_(True)
            # The input's grad is produced by the first layer's backward, i.e. near the end.
            xm.register_hook(lambda g: seen.append(grads.num_launched()))
            _loss(model, xm, ym).backward()
        out["launched_at_input"].append(seen[-1])
        grads.finish()
        out["calls"].append(sum(s["calls"] for s in comm.stats().values()))
        out["grads"].append([p.grad.clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_grads_equal_single_process_and_reduce_once(world):
    flags = [True, False]  # overlapped, then not: results must not depend on it
    results = run_ranks(_grads_rank, world, args=(flags,))
    num_buckets = results[0]["num_buckets"]
    assert num_buckets >= 3
    for it in range(len(flags)):
        ref = _reference_grads(it)
        for r in results:
            for got, want in zip(r["grads"][it], ref):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for r in results:
        # Overlapped: the last layer's bucket went out before backward reached the input.
        assert r["launched_at_input"][0] >= 1
        assert r["launched_at_input"][1] == 0
        # NUM_MICRO microbatches, yet one all-reduce per bucket per iteration.
        assert r["calls"] == [num_buckets] * len(flags)


def test_no_group_path_needs_no_distributed():
    model = _model()
    grads = DataParallelGrads([(model.parameters(), None)], bucket_size=7)
    for it in range(2):
        grads.zero()
        x, y = _batch(it)
        comm.reset_stats()
        for m, (xm, ym) in enumerate(zip(x.chunk(4), y.chunk(4))):
            with grads.last_microbatch() if m == 3 else torch.enable_grad():
                _loss(model, xm, ym).backward()
        grads.finish()
        assert comm.stats() == {}
        for got, want in zip([p.grad for p in model.parameters()], _reference_grads(it)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grad_set_to_none_still_accumulates_into_buffer():
    model = _model()
    grads = DataParallelGrads([(model.parameters(), None)])
    x, y = _batch(0)
    _loss(model, x[:4], y[:4]).backward()
    for p in model.parameters():
        p.grad = None  # e.g. a stray optimizer.zero_grad(); the buffer keeps the sum
    _loss(model, x[4:], y[4:]).backward()
    grads.finish()
    for got, want in zip([p.grad for p in model.parameters()], _reference_grads(0)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_user_errors():
    w = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="appears twice"):
        DataParallelGrads([([w], None), ([w], None)])
    with pytest.raises(ValueError, match="bucket_size"):
        DataParallelGrads([([w], None)], bucket_size=0)
    with pytest.raises(ValueError, match="betas"):
        DistributedOptimizer([([w], None)], lr=1e-3, betas=(0.9, 1.0))
    opt = DistributedOptimizer([([w], None)], lr=1e-3)
    bad = opt.state_dict()
    bad["numel"] = [4]
    with pytest.raises(ValueError, match="full_state_dict"):
        opt.load_state_dict(bad)


# ---------------------------------------------------------------- distributed optimizer

SHAPES_DENSE = [(3, 5), (7,), (2, 3)]  # 15 + 7 + 6 = 28 elements: not a multiple of 4 per bucket
SHAPES_EXPERT = [(5,), (3, 3)]  # 14 elements: odd-sized buckets over pairs
HP = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)


def _init(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _rank_loss(params, rank, step, micro):
    # Nonlinear in the params so the gradient depends on where the optimizer moved them.
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return sum((p * torch.randn(p.shape, generator=g)).sum() + 0.3 * (p**2).sum() for p in params)


def _opt_rank(rank, world, num_steps):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [_opt_run(rank, pairs, distributed, num_steps) for distributed in (True, False)]


def _opt_run(rank, pairs, distributed, num_steps):
    pair = rank // 2
    dense = [torch.nn.Parameter(t) for t in _init(SHAPES_DENSE, 1)]
    expert = [torch.nn.Parameter(t) for t in _init(SHAPES_EXPERT, 2 + pair)]
    groups = [(dense, dist.group.WORLD), (expert, pairs[pair])]
    opt = build_optimizer(groups, distributed=distributed, bucket_size=9, **HP)
    out = {"calls": [], "params": [], "launched_in_backward": []}
    for step in range(num_steps):
        opt.zero_grad()
        comm.reset_stats()
        for micro in range(2):
            opt.grads.set_last_microbatch(micro == 1)
            _rank_loss(dense + expert, rank, step, micro).backward()
        out["launched_in_backward"].append(opt.grads.num_launched())
        opt.grads.finish()
        out["calls"].append(sum(s["calls"] for s in comm.stats().values()))
        opt.step()
        out["params"].append([p.detach().clone() for p in dense + expert])
        if step == num_steps - 2:
            sharded, full = opt.state_dict(), opt.full_state_dict()
            snapshot = [p.detach().clone() for p in dense + expert]
    out["num_buckets"] = [len(b.buckets) for b in opt.grads.buffers]
    out["full"] = full
    if distributed:
        out["state_numel"] = [sum(v.numel() for v in s.values()) for s in opt.shards]
        out["buffer_numel"] = [b.numel for b in opt.grads.buffers]
    # Restore the state saved one step earlier into fresh optimizers and redo the last step.
    out["resumed"] = []
    for kind, state in (("sharded", sharded), ("full", full)):
        new = [torch.nn.Parameter(t.clone()) for t in snapshot]
        fresh = build_optimizer([(new[:3], dist.group.WORLD), (new[3:], pairs[pair])],
                                distributed=distributed, bucket_size=9, **HP)
        fresh.load_state_dict(state) if kind == "sharded" else fresh.load_full_state_dict(state)
        fresh.zero_grad()
        for micro in range(2):
            _rank_loss(new, rank, num_steps - 1, micro).backward()
        fresh.step()
        out["resumed"].append([p.detach().clone() for p in new])
    return out


def _reference_adamw(num_steps):
    """Single process: full params, gradients summed over the ranks sharing each param."""
    dense = [torch.nn.Parameter(t) for t in _init(SHAPES_DENSE, 1)]
    experts = [[torch.nn.Parameter(t) for t in _init(SHAPES_EXPERT, 2 + pair)] for pair in range(2)]
    every = dense + experts[0] + experts[1]
    # Megatron's rule: 1-D params (norm weights, biases) are not decayed.
    opt = torch.optim.AdamW([{"params": [p for p in every if p.dim() > 1]},
                             {"params": [p for p in every if p.dim() == 1], "weight_decay": 0.0}], **HP)
    history = []
    for step in range(num_steps):
        opt.zero_grad()
        for rank in range(4):
            for micro in range(2):
                _rank_loss(dense + experts[rank // 2], rank, step, micro).backward()
        opt.step()
        history.append([[p.detach().clone() for p in dense + experts[pair]] for pair in range(2)])
        if step == num_steps - 2:
            states = [[{k: v.clone() for k, v in opt.state[p].items()} for p in dense + experts[pair]] for pair in range(2)]
    return history, states


def test_optimizer_matches_torch_adamw():
    num_steps = 3
    results = run_ranks(_opt_rank, 4, args=(num_steps,))
    history, states = _reference_adamw(num_steps)
    for rank, kind in itertools.product(range(4), (0, 1)):  # kind 0: distributed
        distributed, r = kind == 0, results[rank][kind]
        pair = rank // 2
        for step in range(num_steps):
            for got, want in zip(r["params"][step], history[step][pair]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        # One collective per bucket per iteration (two microbatches).
        # Every bucket went out during the last backward (all its grads were final).
        assert r["calls"] == r["launched_in_backward"] == [sum(r["num_buckets"])] * num_steps
        full = r["full"]["state"][0] + r["full"]["state"][1]
        assert r["full"]["step"] == num_steps - 1
        for entry, ref in zip(full, states[pair]):
            torch.testing.assert_close(entry["exp_avg"], ref["exp_avg"], rtol=0, atol=1e-6)
            torch.testing.assert_close(entry["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-6, atol=1e-6)
        for resumed in r["resumed"]:
            for got, want in zip(resumed, history[-1][pair]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        if distributed:
            # Two moments, each ~1/n of the (padded) buffer; fp32: no master (the params' own
            # slices of the param buffer are the main params).
            dense_n, expert_n = r["buffer_numel"]
            assert r["state_numel"] == [2 * dense_n // 4, 2 * expert_n // 2]
            assert dense_n < 28 + 4 * r["num_buckets"][0] and expert_n < 14 + 2 * r["num_buckets"][1]


def test_full_state_moves_between_optimizer_kinds_without_groups():
    params = [torch.nn.Parameter(t) for t in _init(SHAPES_DENSE, 1)]
    sharded = DistributedOptimizer([(params, None)], bucket_size=None, **HP)
    sharded.zero_grad()
    _rank_loss(params, 0, 0, 0).backward()
    sharded.step()
    copy = [torch.nn.Parameter(p.detach().clone()) for p in params]
    replicated = ReplicatedOptimizer([(copy, None)], **HP)
    replicated.load_full_state_dict(sharded.full_state_dict())
    for opt, ps in ((sharded, params), (replicated, copy)):
        opt.zero_grad()
        _rank_loss(ps, 0, 1, 0).backward()
        opt.step()
    for a, b in zip(params, copy):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert replicated.num_steps == sharded.num_steps == 2


def _overlap_rank(rank, world, overlap):
    """Three steps of the distributed optimizer on a 3-layer model, dp over ``world``, params all-gathered
    after each step either at once or under the next forward (small buckets: several per step)."""
    model = _model()
    opt = build_optimizer([(model.parameters(), dist.group.WORLD)], distributed=True, bucket_size=20,
                          overlap_param_gather=overlap, **HP)
    hooks = opt.hook_param_gather([model])
    out = {"losses": [], "in_flight_after_step": [], "in_flight_after_forward": [], "buckets": len(opt.grads.buffers[0].buckets)}
    per = GLOBAL_BATCH // world
    for it in range(3):
        opt.zero_grad()
        x, y = _batch(it)
        loss = _loss(model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])
        out["in_flight_after_forward"].append(len(opt._gathering) if overlap else 0)
        loss.backward()
        out["losses"].append(loss.item())
        opt.step()
        out["in_flight_after_step"].append(len(opt._gathering) if overlap else 0)
    opt.finish_param_gather()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    for h in hooks:
        h.remove()
    return out


def test_overlapped_param_gather_waits_layer_by_layer_and_changes_nothing():
    """``overlap_param_gather``: after a step every param's all-gather is still in flight, the next
    forward finishes them through its modules' pre-hooks, and losses and params equal the blocking
    gather's bitwise (a hook that did not wait would compute with the old params)."""
    blocking, overlapped = (run_ranks(_overlap_rank, 2, args=(flag,))[0] for flag in (False, True))
    assert overlapped["buckets"] > 1
    assert overlapped["losses"] == blocking["losses"]
    for got, want in zip(overlapped["params"], blocking["params"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert overlapped["in_flight_after_step"] == [6, 6, 6]  # the 3 layers' weights and biases
    assert overlapped["in_flight_after_forward"] == [0, 0, 0]


class _CopiesInto(TorchDispatchMode):
    """Counts the ops writing into the storages ``storages`` by a copy (``copy_``, or any op
    with an ``out=``)."""

    def __init__(self, storages):
        super().__init__()
        self.storages, self.counts = storages, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dst = args[0] if func is torch.ops.aten.copy_.default else kwargs.get("out")
        if isinstance(dst, torch.Tensor) and dst.untyped_storage().data_ptr() in self.storages:
            self.counts[str(func)] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_distributed_optimizer_params_are_one_flat_buffer_and_an_fp32_step_copies_nothing(param_dtype):
    """As Megatron-Core's distributed optimizer: every param of a group is a view of one flat
    param buffer laid out as the gradient buffer; in fp32 this rank's slices of it are the main
    params (a step at dp 1 copies no param: no master to load, no all-gather), in bf16 the fp32
    main shard is rounded into them by one copy per bucket."""
    groups = [[torch.nn.Parameter(t) for t in _init(shapes, seed)]
              for shapes, seed in ((SHAPES_DENSE, 1), (SHAPES_EXPERT, 2))]
    reference = [[p.detach().clone() for p in params] for params in groups]
    opt = DistributedOptimizer([(params, None) for params in groups], bucket_size=9, param_dtype=param_dtype, **HP)
    for params, buf, pbuf, ref in zip(groups, opt.grads.buffers, opt.param_buffers, reference):
        assert pbuf.numel() == buf.numel and pbuf.dtype == (param_dtype or torch.float32)
        assert {p.untyped_storage().data_ptr() for p in params} == {pbuf.untyped_storage().data_ptr()}
        for p, want in zip(params, ref):
            assert torch.equal(p.detach(), want.to(pbuf.dtype))
    _rank_loss([p for params in groups for p in params], 0, 0, 0).backward()
    with _CopiesInto({pbuf.untyped_storage().data_ptr() for pbuf in opt.param_buffers}) as ops:
        opt.step()
    rounding = 0 if param_dtype is None else sum(len(buf.buckets) for buf in opt.grads.buffers)
    assert sum(ops.counts.values()) == ops.counts["aten.copy_.default"] == rounding, ops.counts
    assert all(not torch.equal(p.detach(), want.to(p.dtype)) for params, ref in zip(groups, reference)
               for p, want in zip(params, ref))
