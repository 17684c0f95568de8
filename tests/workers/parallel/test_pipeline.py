"""Pipeline parallelism: partition, schedule tables, their checkers, and executor parity."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from workers.parallel.pipeline import (
    Action,
    in_flight_bound,
    partition_layers,
    schedule,
    schedule_1f1b,
    schedule_interleaved,
)
from workers.parallel.pipeline_check import check_message_order, check_schedule, check_stage, max_in_flight, simulate
from workers.parallel.pipeline_exec import run_pipeline
from workers.parallel.pipeline_p2p import Step, check_nccl_safe, p2p_plan, simulate_nccl
from tests.helpers.ranks import run_ranks


def _acts(text: str) -> list[Action]:
    """'F0.1 B0' -> [Action('F', 0, 1), Action('B', 0, 0)]."""
    out = []
    for tok in text.split():
        mb, _, chunk = tok[1:].partition(".")
        out.append(Action(tok[0], int(mb), int(chunk or 0)))
    return out


# ----------------------------------------------------------------------------- partition


def test_partition_interleaved_assignment():
    assert partition_layers(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert partition_layers(4, 4) == [[[0]], [[1]], [[2]], [[3]]]
    assert partition_layers(6, 1) == [[[0, 1, 2, 3, 4, 5]]]


@pytest.mark.parametrize("layers,pp,vpp", [(48, 4, 3), (64, 16, 4), (12, 3, None)])
def test_partition_covers_every_layer_once_in_virtual_order(layers, pp, vpp):
    parts = partition_layers(layers, pp, vpp)
    chunks = vpp or 1
    by_virtual = [parts[v % pp][v // pp] for v in range(pp * chunks)]
    assert [i for part in by_virtual for i in part] == list(range(layers))
    assert {len(p) for p in by_virtual} == {layers // (pp * chunks)}


def test_partition_errors_name_numbers():
    with pytest.raises(ValueError, match=r"num_layers 10 .* = 4"):
        partition_layers(10, 2, 2)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size > 1"):
        partition_layers(8, 1, 2)


# ----------------------------------------------------------------------------- tables


def test_1f1b_matches_megatron_by_hand():
    assert schedule_1f1b(6, 4, 1) == _acts("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5")
    assert schedule_1f1b(6, 4, 3) == _acts("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5")
    # fewer microbatches than warm-up slots: GPipe-like
    assert schedule_1f1b(2, 4, 0) == _acts("F0 F1 B0 B1")


def test_pp1_is_gradient_accumulation():
    assert schedule(3, 1, None, 0) == _acts("F0 B0 F1 B1 F2 B2")
    assert schedule(3, 1, 1, 0) == _acts("F0 B0 F1 B1 F2 B2")


def test_interleaved_matches_megatron_by_hand():
    # pp=2, vpp=2, m=4: stage 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards.
    assert schedule_interleaved(4, 2, 2, 0) == _acts(
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    )
    assert schedule_interleaved(4, 2, 2, 1) == _acts(
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    )
    assert schedule(4, 2, 2, 1) == schedule_interleaved(4, 2, 2, 1)


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) .* pipeline_model_parallel_size \(4\)"):
        schedule_interleaved(6, 4, 2, 0)
    with pytest.raises(ValueError, match="stage 4"):
        schedule_1f1b(4, 4, 4)
    with pytest.raises(ValueError, match="num_microbatches"):
        schedule_1f1b(0, 2, 0)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size > 1"):
        schedule(4, 1, 2, 0)


_COMBOS = [(m, pp, None) for pp in (1, 2, 3, 4, 8, 16) for m in (1, 2, 3, 5, 8, 17, 64)] + [
    (m, pp, vpp) for pp in (2, 3, 4, 8, 16) for vpp in (1, 2, 3, 4) for m in (pp, 2 * pp, 3 * pp, 4 * pp)
]


@pytest.mark.parametrize("m,pp,vpp", [(64, 16, 4), (64, 16, None), (48, 8, 3)])
def test_large_schedules_check(m, pp, vpp):
    assert check_schedule(m, pp, vpp) == 2 * (m * (vpp or 1) + pp - 1)


def test_all_schedules_complete_deadlock_free_bounded_and_bubble_optimal():
    # Unit-time F and B: the ideal makespan is the work (2 m vpp) plus the fill and drain
    # bubble (2 (pp - 1)) - the textbook (pp - 1) / (m vpp) bubble fraction.
    for m, pp, vpp in _COMBOS:
        assert check_schedule(m, pp, vpp) == 2 * (m * (vpp or 1) + pp - 1), (m, pp, vpp)
        chunks = vpp or 1
        for s in range(pp):
            peak = max_in_flight(schedule(m, pp, vpp, s))
            if chunks == 1:
                assert peak == min(pp - s, m), (m, pp, s)
            assert peak <= in_flight_bound(m, pp, vpp, s)


# ----------------------------------------------------------------------------- checkers fail


def test_check_stage_rejects_bad_tables():
    with pytest.raises(ValueError, match="twice"):
        check_stage(_acts("F0 F0 B0"), 1)
    with pytest.raises(ValueError, match="before its forward"):
        check_stage(_acts("B0 F0"), 1)
    with pytest.raises(ValueError, match="expected 2"):
        check_stage(_acts("F0 B0"), 2)
    with pytest.raises(ValueError, match="invalid"):
        check_stage(_acts("F0.1 B0.1"), 1, vpp=1)
    check_stage(_acts("F0.0 F0.1 B0.1 B0.0"), 1, vpp=2)


def test_simulate_detects_deadlock_and_counts_bubble():
    # stage 1 wants microbatch 1 first; stage 0 waits for B0, which stage 1 runs only after B1.
    with pytest.raises(ValueError, match="deadlock"):
        simulate([_acts("F0 B0 F1 B1"), _acts("F1 B1 F0 B0")])
    # interleaved: chunk 1 on stage 0 needs chunk 0 of stage 1 first.
    with pytest.raises(ValueError, match="deadlock"):
        simulate([_acts("F0.1 F0.0 B0.1 B0.0"), _acts("F0.0 F0.1 B0.1 B0.0")], vpp=2)
    # GPipe (all F then all B) works but takes the same time here, and holds m activations.
    gpipe = [_acts("F0 F1 F2 F3 B0 B1 B2 B3")] * 2
    assert simulate(gpipe) == 10
    assert max_in_flight(gpipe[0]) == 4 > in_flight_bound(4, 2, None, 0) == 2


# ----------------------------------------------------------------------------- NCCL semantics


def _admitted():
    """Every (pp, vpp, m) the spec validation admits up to pp 8, vpp 4, m 32."""
    for pp in range(1, 9):
        for vpp in (None, 1, 2, 3, 4):
            if vpp is not None and pp == 1:
                continue  # vpp needs pp > 1
            for m in range(1, 33):
                if vpp is not None and m % pp:
                    continue  # the interleaved schedule needs m a multiple of pp
                yield pp, vpp, m


# A valid table whose neighbours send and receive in opposite orders.
_REORDERED = [_acts("F0 F1 F2 F3 B0 B1 B2 B3"), _acts("F3 F2 F1 F0 B3 B2 B1 B0")]


def _old_posting_order(plan: list[Step]) -> list[Step]:
    """The executor before NCCL-safety: every send and every receive posted on its own."""
    return [Step((op,), ()) for step in plan for op in step.ops]


def test_every_admitted_schedule_is_deadlock_free_under_nccl():
    combos = list(_admitted())
    assert len(combos) == 468
    for pp, vpp, m in combos:
        check_nccl_safe(m, pp, vpp)


def test_old_posting_order_deadlocks_under_nccl():
    deadlocked = 0
    for pp, vpp, m in _admitted():
        plans = [_old_posting_order(p2p_plan(schedule(m, pp, vpp, s), s, pp, vpp or 1)) for s in range(pp)]
        try:
            simulate_nccl(plans)
        except ValueError as e:
            assert "deadlock" in str(e)
            deadlocked += 1
    assert deadlocked == 429  # every pipeline with a steady state (pp > 1, m > 1)
    # The cases the review named.
    for m, pp, vpp in [(4, 2, None), (8, 4, None), (4, 2, 2), (8, 4, 2)]:
        plans = [_old_posting_order(p2p_plan(schedule(m, pp, vpp, s), s, pp, vpp or 1)) for s in range(pp)]
        with pytest.raises(ValueError, match="deadlock"):
            simulate_nccl(plans)


def test_plan_batches_send_and_receive_of_a_step_together():
    # 1F1B steady state on stage 0 of pp2: after F1, send F1's output and receive B0's
    # gradient in one batch (Megatron's send_forward_recv_backward).
    plan = p2p_plan(schedule(4, 2, None, 0), 0, 2)
    step = plan[2]
    assert step.actions == (Action("B", 0),)
    assert [(op.kind, op.peer, op.message) for op in step.ops] == [("send", 1, ("F", 1, 0)), ("recv", 1, ("B", 0, 1))]
    # Interleaved steady state: F and B computed back to back, then four tensors in one batch.
    plan = p2p_plan(schedule(8, 2, 2, 0), 0, 2, 2)
    assert any(len(s.actions) == 2 and len(s.ops) == 4 for s in plan)


def test_nccl_simulator_rejects_mismatched_pair_order():
    # Valid tables whose neighbours send and receive in opposite orders: only tags could pair
    # them up, and NCCL has none.
    plans = [p2p_plan(t, s, 2) for s, t in enumerate(_REORDERED)]
    with pytest.raises(ValueError, match="received as"):
        simulate_nccl(plans)


# ----------------------------------------------------------------------------- executor

_S, _B, _H, _L = 3, 2, 4, 8
_CONFIGS = [(pp, vpp, m) for pp in (2, 4) for vpp in (1, 2) for m in (pp, 8)]
_IDS = [f"pp{p}-vpp{v}-m{m}" for p, v, m in _CONFIGS]


def _toy_model():
    g = torch.Generator().manual_seed(7)
    layers = []
    for _ in range(_L):
        lin = torch.nn.Linear(_H, _H)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(_H, _H, generator=g) * 0.5)
            lin.bias.copy_(torch.randn(_H, generator=g) * 0.1)
        layers.append(torch.nn.Sequential(lin, torch.nn.Tanh()))
    return layers


def _data(m):
    g = torch.Generator().manual_seed(11)
    return torch.randn(m, _S, _B, _H, generator=g), torch.randn(m, _S, _B, _H, generator=g)


def _loss(out, target, m):
    return ((out - target) ** 2).mean() / m


def _reference(m):
    layers = _toy_model()
    inputs, targets = _data(m)
    total = 0.0
    for mb in range(m):
        x = inputs[mb]
        for layer in layers:
            x = layer(x)
        loss = _loss(x, targets[mb], m)
        loss.backward()
        total += loss.item()
    grads = {i: (l[0].weight.grad.clone(), l[0].bias.grad.clone()) for i, l in enumerate(layers)}
    return total, grads


def _pipeline_rank(rank, world_size):
    groups = {(0, 1): dist.new_group([0, 1]), (2, 3): dist.new_group([2, 3]), (0, 1, 2, 3): dist.new_group([0, 1, 2, 3])}
    results = []
    for index, (pp, vpp, m) in enumerate(_CONFIGS):
        # pp=2 runs two independent pipelines at once, one per half of the world.
        ranks = tuple(range(world_size)) if pp == world_size else ((0, 1) if rank < 2 else (2, 3))
        stage = ranks.index(rank)
        layers = _toy_model()
        mine = partition_layers(_L, pp, vpp if vpp > 1 else None)[stage]
        chunks = [torch.nn.Sequential(*(layers[i] for i in idx)) for idx in mine]
        inputs, targets = _data(m)
        table = schedule(m, pp, vpp, stage)
        losses = run_pipeline(
            table,
            stage=stage,
            pp=pp,
            vpp=vpp,
            pp_ranks=ranks,
            chunks=chunks,
            num_microbatches=m,
            get_input=lambda mb: inputs[mb],
            loss_fn=lambda mb, out: _loss(out, targets[mb], m),
            tensor_shape=(_S, _B, _H),
            group=groups[ranks],
        )
        grads = {i: (layers[i][0].weight.grad.numpy(), layers[i][0].bias.grad.numpy()) for idx in mine for i in idx}
        # numpy, not tensors: a tensor crosses the result queue as a shared-memory handle that
        # dies with the rank process.
        results.append(([l.item() for l in losses], grads))
        dist.barrier()  # keep configurations apart
    return results


@pytest.fixture(scope="module")
def pipeline_results():
    return run_ranks(_pipeline_rank, 4)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_CONFIGS)), ids=_IDS)
def test_executor_matches_single_process(pipeline_results, index):
    pp, vpp, m = _CONFIGS[index]
    ref_loss, ref_grads = _reference(m)
    pipelines = [(0, 1, 2, 3)] if pp == 4 else [(0, 1), (2, 3)]
    for ranks in pipelines:
        per_rank = [pipeline_results[r][index] for r in ranks]
        assert all(not losses for losses, _ in per_rank[:-1])
        losses = per_rank[-1][0]
        assert len(losses) == m
        assert sum(losses) == pytest.approx(ref_loss, abs=1e-5)
        grads = {i: g for _, gs in per_rank for i, g in gs.items()}
        assert sorted(grads) == list(range(_L))
        for i, (w, b) in grads.items():
            torch.testing.assert_close(torch.from_numpy(w), ref_grads[i][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.from_numpy(b), ref_grads[i][1], atol=1e-5, rtol=0)


def test_reordered_table_is_valid_but_needs_tags():
    for table in _REORDERED:
        check_stage(table, 4)
    simulate(_REORDERED)
    with pytest.raises(ValueError, match="stage 0 -> 1"):
        check_message_order(_REORDERED)


def test_executor_single_stage_needs_no_group():
    m = 3
    layers = _toy_model()
    inputs, targets = _data(m)
    losses = run_pipeline(
        schedule(m, 1, None, 0),
        stage=0,
        pp=1,
        vpp=1,
        pp_ranks=[0],
        chunks=[torch.nn.Sequential(*layers)],
        num_microbatches=m,
        get_input=lambda mb: inputs[mb],
        loss_fn=lambda mb, out: _loss(out, targets[mb], m),
        tensor_shape=(_S, _B, _H),
    )
    ref_loss, ref_grads = _reference(m)
    assert sum(l.item() for l in losses) == pytest.approx(ref_loss, abs=1e-6)
    torch.testing.assert_close(layers[0][0].weight.grad, ref_grads[0][0], atol=1e-6, rtol=0)


def test_executor_rejects_mismatched_sizes():
    with pytest.raises(ValueError, match=r"len\(chunks\) == vpp \(got 1\)"):
        run_pipeline(
            [], stage=0, pp=2, vpp=2, pp_ranks=[0, 1], chunks=[torch.nn.Identity()], num_microbatches=2,
            get_input=None, loss_fn=None, tensor_shape=(1,),
        )


def _recording_rank(rank, world_size):
    """Run pp2 interleaved and pp2 1F1B, recording every comm.p2p call the executor makes."""
    from workers.parallel import comm

    calls = []
    original = comm.p2p

    def recording(sends, recvs, group=None):
        calls.append((tuple(("send", peer) for _, peer, *_ in sends), tuple(("recv", peer) for _, peer, *_ in recvs),
                      tuple(tuple(t.shape) for t, *_ in sends)))
        return original(sends, recvs, group)

    comm.p2p = recording
    out = []
    for vpp, m in ((2, 4), (1, 4)):
        calls.clear()
        layers = _toy_model()
        mine = partition_layers(_L, 2, vpp if vpp > 1 else None)[rank]
        inputs, targets = _data(m)
        run_pipeline(schedule(m, 2, vpp if vpp > 1 else None, rank), stage=rank, pp=2, vpp=vpp, pp_ranks=(0, 1),
                     chunks=[torch.nn.Sequential(*(layers[i] for i in idx)) for idx in mine], num_microbatches=m,
                     get_input=lambda mb: inputs[mb], loss_fn=lambda mb, o: _loss(o, targets[mb], m),
                     tensor_shape=(_S, _B, _H))
        out.append(list(calls))
    return out


@pytest.mark.slow
def test_executor_posts_exactly_the_plan():
    """What the NCCL simulator proves is what runs: one comm.p2p batch per non-empty plan step,
    with the plan's sends and receives, in order."""
    results = run_ranks(_recording_rank, 2)
    for rank, per_config in enumerate(results):
        for (vpp, m), calls in zip(((2, 4), (1, 4)), per_config):
            plan = p2p_plan(schedule(m, 2, vpp if vpp > 1 else None, rank), rank, 2, vpp)
            want = [(tuple(("send", op.peer) for op in step.ops if op.kind == "send"),
                     tuple(("recv", op.peer) for op in step.ops if op.kind == "recv")) for step in plan if step.ops]
            assert [(s, r) for s, r, _ in calls] == want, (rank, vpp)
            assert all(shape == (_S, _B, _H) for _, _, shapes in calls for shape in shapes)



def _linear_pair():
    g = torch.Generator().manual_seed(5)
    layers = [torch.nn.Linear(_H, _H) for _ in range(2)]
    with torch.no_grad():
        for lin in layers:
            lin.weight.copy_(torch.randn(_H, _H, generator=g) * 0.5)
            lin.bias.copy_(torch.randn(_H, generator=g) * 0.1)
    return layers


class _Residual(torch.nn.Module):
    """``x + linear(x)``: as a decoder layer ends, on a fresh tensor (not a view) whose backward
    needs neither its output nor its inputs' data beyond the Linear's."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return x + self.linear(x)


def _dealloc_rank(rank, world_size):
    """1F1B over two stages of one residual Linear each: what the first stage's outputs hold once
    sent, and whether the backward imported sympy."""
    import sys

    m = 4
    sympy_before = "sympy" in sys.modules
    layers = _linear_pair()
    outputs = []
    chunks = [_Residual(lin) for lin in layers]
    chunks[0].register_forward_hook(lambda mod, args, out: outputs.append(out))
    inputs, targets = _data(m)
    run_pipeline(schedule(m, 2, None, rank), stage=rank, pp=2, vpp=1, pp_ranks=(0, 1), chunks=[chunks[rank]],
                 num_microbatches=m, get_input=lambda mb: inputs[mb], loss_fn=lambda mb, o: _loss(o, targets[mb], m),
                 tensor_shape=(_S, _B, _H))
    return {"numels": [o.numel() for o in outputs], "sympy_before": sympy_before, "sympy_after": "sympy" in sys.modules,
            "grad": layers[rank].weight.grad.numpy()}


@pytest.mark.slow
def test_a_stage_frees_each_output_once_sent_and_backpropagates_without_autograd_shape_checks():
    """Megatron's deallocate_output_tensor + custom_backward: stage 0's outputs (up to pp microbatches
    in flight in 1F1B) keep one element each once sent, the gradients are a single process's, and the
    backward does not import torch.fx's symbolic shapes (sympy: ~32 MB resident per stage, measured).
    Breaks if an output is kept whole, or with torch.autograd.backward (it imports sympy to compare
    the gradient's shape with the output's, and refuses the emptied output)."""
    results = run_ranks(_dealloc_rank, 2)
    assert results[0]["numels"] == [1] * 4
    assert not results[0]["sympy_before"] and not results[0]["sympy_after"]
    m = 4
    ref = _linear_pair()
    chunks = [_Residual(lin) for lin in ref]
    inputs, targets = _data(m)
    for mb in range(m):
        _loss(chunks[1](chunks[0](inputs[mb])), targets[mb], m).backward()
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(results[rank]["grad"]), ref[rank].weight.grad, atol=1e-6, rtol=0)
