"""Gradient clipping by the global norm (workers.parallel.clip) and the norm reported per step.

The layout half of the acceptance test lives in the parity suites: the parity job clips at
``clip_grad: 0.05`` (below every iteration's norm, so clipping acts in every step) and
:func:`parity.check_layout` compares every layout's losses and reported grad norms with the
single process (tp2 without SP exercises the TP-duplicate rule, tp2+sp the sequence-parallel
norms, dp4/pp2-dp2 with the distributed optimizer the sharded norm, MoE ep2/etp the expert
grads, the 16-rank 5D layout all at once).
"""

import math

import pytest
import torch

from tests.helpers.parity import CLIP, metric, reference
from workers.parallel.clip import counted_on_this_tp_rank, global_grad_norm
from workers.parallel.optimizer import build_optimizer


def _model_and_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    return model, lambda: ((model(x) - y) ** 2).mean() * 50


@pytest.mark.parametrize("distributed", [False, True])
def test_norm_is_torchs_and_grads_are_clipped_to_clip_grad(distributed):
    model, loss = _model_and_loss()
    opt = build_optimizer([(model.parameters(), None)], distributed=distributed, lr=1e-3, clip_grad=0.5)
    opt.zero_grad()
    loss().backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])).item()
    assert want > 0.5
    info = opt.step()
    assert info.grad_norm == pytest.approx(want, rel=1e-6)
    assert not info.skipped
    clipped = torch.cat([g.reshape(-1) for g in opt.main_grads()])
    assert torch.linalg.vector_norm(clipped).item() == pytest.approx(0.5, rel=1e-5)


def test_no_clipping_below_the_threshold_or_when_off():
    for clip in (0.0, 1e9):
        model, loss = _model_and_loss()
        opt = build_optimizer([(model.parameters(), None)], distributed=False, lr=1e-3, clip_grad=clip)
        opt.zero_grad()
        loss().backward()
        before = torch.cat([g.clone() for g in opt.main_grads()])
        info = opt.step()
        assert info.grad_norm > 0
        assert torch.equal(torch.cat(opt.main_grads()), before)


def test_non_finite_norm_is_reported_and_the_update_is_skipped():
    model, loss = _model_and_loss()
    opt = build_optimizer([(model.parameters(), None)], distributed=False, lr=1e-3, clip_grad=1.0)
    opt.zero_grad()
    loss().backward()
    model[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    info = opt.step()
    assert math.isinf(info.grad_norm) and info.skipped
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.num_steps == 0  # the LR schedule does not advance either


def test_tp_duplicates_count_once():
    norm = torch.nn.Parameter(torch.ones(3))
    shard = torch.nn.Parameter(torch.ones(3))
    shard.tensor_model_parallel = True
    seq = torch.nn.Parameter(torch.ones(3))
    seq.sequence_parallel = True
    expert = torch.nn.Parameter(torch.ones(3))
    expert.is_expert = True
    assert [counted_on_this_tp_rank(p, 1) for p in (norm, shard, seq, expert)] == [False, True, True, True]
    assert all(counted_on_this_tp_rank(p, 0) for p in (norm, shard, seq, expert))
    pairs = [(p, torch.full((3,), 2.0)) for p in (norm, shard)]
    assert global_grad_norm(pairs, tp_rank=1, group=None) == pytest.approx(math.sqrt(12))
    assert global_grad_norm(pairs, tp_rank=0, group=None) == pytest.approx(math.sqrt(24))


def test_parity_job_clips_in_every_iteration():
    """The layout acceptance runs only mean something if clipping is active in each step."""
    norms = metric(reference(), "grad_norm")
    assert all(n > 2 * CLIP for n in norms), norms
