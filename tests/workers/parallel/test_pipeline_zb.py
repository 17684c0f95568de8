"""Zero-bubble pipeline schedules (ZB-H1, ZBV): tables, their proofs, the B/W split of the
weight gradient, and executor parity with a single process."""

from __future__ import annotations

import pytest
import torch

from workers.parallel import wgrad
from workers.parallel.pipeline import Action, partition_layers, place, schedule, schedule_forward_only, virtual_stage
from workers.parallel.pipeline_check import check_schedule, check_stage, max_in_flight, simulate
from workers.parallel.pipeline_exec import run_pipeline
from workers.parallel.pipeline_p2p import check_nccl_safe, p2p_plan, plan_all, simulate_nccl
from tests.helpers.ranks import run_ranks


def _admitted_zb():
    """Every (name, pp, vpp, m) of a zero-bubble schedule the spec admits up to pp 8, m 32."""
    for pp in range(2, 9):
        for m in range(1, 33):
            yield "zb-h1", pp, None, m
            if m >= 2 * pp:
                yield "zbv", pp, 2, m


def test_every_admitted_zero_bubble_schedule_is_complete_deadlock_free_and_bounded():
    """Each table runs every F, B and W once in order, within its activation bound, with each
    pair's messages in order, and under NCCL's semantics (training and evaluation) finishes."""
    combos = list(_admitted_zb())
    assert len(combos) == 7 * 32 + sum(33 - 2 * pp for pp in range(2, 9))
    for name, pp, vpp, m in combos:
        check_schedule(m, pp, vpp, name)
        check_nccl_safe(m, pp, vpp, name=name)
        check_nccl_safe(m, pp, vpp, name=name, forward_only=True)


def test_zero_bubble_makespans_beat_1f1b():
    """F, B and W of one unit each (1F1B's backward is B + W): 1F1B's bubble is 3 (pp - 1),
    ZB-H1's pp - 1 (Qi et al.'s (pp - 1)(F + B - W)); ZBV's chunks are half a stage, its
    bubble pp - 1 half-units."""
    for pp in (2, 4, 8):
        for m in (pp, 2 * pp, 32):
            one = check_schedule(m, pp, None, "1f1b", cost={"B": 2})
            assert one == 3 * m + 3 * (pp - 1)
            assert check_schedule(m, pp, None, "zb-h1") == 3 * m + pp - 1
            if m >= 2 * pp:
                assert check_schedule(m, pp, 2, "zbv") == 6 * m + pp - 1
    # ZB-H1's memory: at most pp microbatches' activations on any stage (1F1B: pp - s).
    assert [max_in_flight(schedule(16, 4, None, s, "zb-h1")) for s in range(4)] == [4, 4, 4, 4]


def test_zbh1_table_by_hand():
    # pp 2, m 3: stage 1 keeps one W pending, stage 0 none.
    assert schedule(3, 2, None, 0, "zb-h1") == _acts("F0 F1 B0 W0 F2 B1 W1 B2 W2")
    assert schedule(3, 2, None, 1, "zb-h1") == _acts("F0 B0 F1 B1 W0 F2 B2 W1 W2")


def test_v_placement():
    assert partition_layers(8, 2, 2, v_shape=True) == [[[0, 1], [6, 7]], [[2, 3], [4, 5]]]
    for pp in (2, 4, 8):
        for v in range(2 * pp):
            assert virtual_stage(*place(v, pp, True), pp, True) == v
    assert [place(v, 4, True)[0] for v in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_v_turn_is_local_and_loss_on_stage_0():
    tables = [schedule(8, 4, 2, s, "zbv") for s in range(4)]
    plans = plan_all(tables, 2, True)
    ops = [op for step in plans[3] for op in step.ops]
    assert {op.peer for op in ops} == {2}  # the last stage only talks to stage 2
    assert schedule_forward_only(4, 2, 2, 0, "zbv") == _acts("F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1")


def test_zbv_needs_plan_all():
    """Posting each send with the next step's receives (enough for 1F1B, interleaved and ZB-H1)
    deadlocks ZBV under NCCL: stage pairs send each other gradients the other receives later.
    Breaks if plan_all stops holding those sends back."""
    tables = [schedule(8, 4, 2, s, "zbv") for s in range(4)]
    with pytest.raises(ValueError, match="deadlock"):
        simulate_nccl([p2p_plan(t, s, 4, 2, v_shape=True, tables=tables) for s, t in enumerate(tables)])
    simulate_nccl(plan_all(tables, 2, True))


def test_zero_bubble_refusals_name_the_fields():
    with pytest.raises(ValueError, match=r"zbv needs virtual_pipeline_model_parallel_size 2 \(got 3\)"):
        schedule(8, 2, 3, 0, "zbv")
    with pytest.raises(ValueError, match=r"zb-h1 needs pipeline_model_parallel_size > 1"):
        schedule(8, 1, None, 0, "zb-h1")
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) >= 2 x pipeline_model_parallel_size \(8\)"):
        schedule(6, 4, 2, 0, "zbv")
    with pytest.raises(ValueError, match=r"zb-h1 runs one chunk per stage"):
        schedule(8, 2, 2, 0, "zb-h1")
    with pytest.raises(ValueError, match="not one of"):
        schedule(8, 2, None, 0, "gpipe")


def test_check_stage_wants_each_w_once_after_its_b():
    check_stage(_acts("F0 B0 W0"), 1)
    with pytest.raises(ValueError, match="before its backward"):
        check_stage(_acts("F0 W0 B0"), 1)
    with pytest.raises(ValueError, match="expected 2"):
        check_stage(_acts("F0 F1 B0 B1 W0"), 2)
    # A W ahead of its B's peer: deadlock-free only if the simulator sees W wait for B.
    assert simulate([_acts("F0 B0 W0"), _acts("F0 B0 W0")]) == 5


def _acts(text: str) -> list[Action]:
    out = []
    for tok in text.split():
        mb, _, chunk = tok[1:].partition(".")
        out.append(Action(tok[0], int(mb), int(chunk or 0)))
    return out


# ----------------------------------------------------------------------------- the B/W split


class _Layer(torch.nn.Module):
    """``tanh(x @ W.T + b)`` through :func:`workers.parallel.wgrad.linear`, so that, with a
    ``main_grad`` (the data-parallel buffer), the weight gradient is fused and can be deferred."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)

    def forward(self, x):
        return torch.tanh(wgrad.linear(x, self.weight) + self.bias)


_S, _B, _H, _L = 3, 2, 4, 8


def _toy_model():
    g = torch.Generator().manual_seed(7)
    return [_Layer(torch.randn(_H, _H, generator=g) * 0.5, torch.randn(_H, generator=g) * 0.1) for _ in range(_L)]


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
    return total, {i: (l.weight.grad.clone(), l.bias.grad.clone()) for i, l in enumerate(layers)}


def test_deferred_weight_gradient_is_the_same_and_its_hook_runs_at_w():
    """In one process: a backward inside deferred_wgrads leaves the linear weights' buffer
    untouched and their hooks unrun (their bucket is not ready though armed), the biases done;
    run_wgrads gives the unsplit backward's gradients exactly and marks the bucket ready.
    Breaks if the GEMM runs in B, or if run_wgrads skips autograd (no hook, no reduction)."""
    from workers.parallel.data import DataParallelGrads

    m = 2
    ref_loss, ref = _reference(m)
    layers = _toy_model()
    grads = DataParallelGrads([([p for l in layers for p in l.parameters()], None)], bucket_size=None)
    grads.zero()
    inputs, targets = _data(m)
    for mb in range(m):
        x = inputs[mb]
        for layer in layers:
            x = layer(x)
        if mb == m - 1:
            grads.arm(p for l in layers for p in l.parameters())
        with wgrad.deferred_wgrads() as queue:
            _loss(x, targets[mb], m).backward()
        assert len(queue) == _L
        if mb == 0:
            assert all(float(l.weight.main_grad.abs().sum()) == 0 for l in layers)
            assert all(float(l.bias.main_grad.abs().sum()) > 0 for l in layers)
        assert grads.num_launched() == 0
        wgrad.run_wgrads(queue)
    assert grads.num_launched() == 1
    grads.finish()
    for i, layer in enumerate(layers):
        torch.testing.assert_close(layer.weight.grad, ref[i][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.bias.grad, ref[i][1], atol=1e-6, rtol=0)
    grads.remove_hooks()


# ----------------------------------------------------------------------------- executor parity

_CONFIGS = [("zb-h1", 2, 1, 4), ("zb-h1", 4, 1, 8), ("zbv", 2, 2, 4), ("zbv", 4, 2, 8)]
_IDS = [f"{n}-pp{p}-m{m}" for n, p, _, m in _CONFIGS]


def _zb_rank(rank, world_size):
    import torch.distributed as dist

    from workers.parallel.data import DataParallelGrads
    from workers.parallel.pipeline import V_SHAPED

    groups = {(0, 1): dist.new_group([0, 1]), (2, 3): dist.new_group([2, 3]), (0, 1, 2, 3): dist.new_group([0, 1, 2, 3])}
    results = []
    for name, pp, vpp, m in _CONFIGS:
        ranks = tuple(range(world_size)) if pp == world_size else ((0, 1) if rank < 2 else (2, 3))
        stage, v_shape = ranks.index(rank), name in V_SHAPED
        layers = _toy_model()
        mine = partition_layers(_L, pp, vpp if vpp > 1 else None, v_shape=v_shape)[stage]
        chunks = [torch.nn.Sequential(*(layers[i] for i in idx)) for idx in mine]
        params = [p for c in chunks for p in c.parameters()]
        grads = DataParallelGrads([(params, None)], bucket_size=None)  # main_grad: the W is deferred
        grads.zero()
        inputs, targets = _data(m)
        tables = [schedule(m, pp, vpp if vpp > 1 else None, s, name) for s in range(pp)]
        timeline, armed = [], []
        losses = run_pipeline(
            tables[stage], stage=stage, pp=pp, vpp=vpp, pp_ranks=ranks, chunks=chunks, num_microbatches=m,
            get_input=lambda mb: inputs[mb], loss_fn=lambda mb, out: _loss(out, targets[mb], m),
            tensor_shape=(_S, _B, _H), group=groups[ranks], v_shape=v_shape,
            plan=plan_all(tables, vpp, v_shape)[stage], timeline=timeline,
            before_last_backward=lambda c: (armed.append(c), grads.arm(chunks[c].parameters())),
        )
        launched = grads.num_launched()
        grads.finish()
        out = {i: (layers[i].weight.grad.numpy().copy(), layers[i].bias.grad.numpy().copy())
               for idx in mine for i in idx}
        results.append({"losses": [l.item() for l in losses], "grads": out, "launched": launched,
                        "kinds": [k for k, *_ in timeline], "armed": armed})
        grads.remove_hooks()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def zb_results():
    return run_ranks(_zb_rank, 4)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_CONFIGS)), ids=_IDS)
def test_zero_bubble_executor_matches_single_process(zb_results, index):
    """Loss to 1e-6 and every gradient to 1e-5 of the single process, with the linear weights'
    gradients run in the W steps (the chunks' buckets go out at the last W, not before)."""
    name, pp, vpp, m = _CONFIGS[index]
    ref_loss, ref_grads = _reference(m)
    pipelines = [(0, 1, 2, 3)] if pp == 4 else [(0, 1), (2, 3)]
    loss_stage = 0 if name == "zbv" else pp - 1
    for ranks in pipelines:
        per_rank = [zb_results[r][index] for r in ranks]
        assert all(not r["losses"] for s, r in enumerate(per_rank) if s != loss_stage)
        losses = per_rank[loss_stage]["losses"]
        assert len(losses) == m
        assert sum(losses) == pytest.approx(ref_loss, rel=1e-6)
        for r in per_rank:
            assert r["kinds"].count("W") == r["kinds"].count("B") == m * vpp
            assert r["launched"] == 1 and sorted(r["armed"]) == list(range(vpp))
        grads = {i: g for r in per_rank for i, g in r["grads"].items()}
        assert sorted(grads) == list(range(_L))
        for i, (w, b) in grads.items():
            torch.testing.assert_close(torch.from_numpy(w), ref_grads[i][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.from_numpy(b), ref_grads[i][1], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the trainer

_TRAINER_LAYOUTS = {
    # name: (world, parallel, model overrides)
    "pp2-zb-h1-dp2-distopt": (4, {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1",
                                  "use_distributed_optimizer": True}, {}),
    "pp4-zb-h1": (4, {"pipeline_model_parallel_size": 4, "pipeline_schedule": "zb-h1"}, {}),
    "pp2-zbv": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                    "pipeline_schedule": "zbv"}, {}),
    # 8 microbatches at pp 4: ZBV's minimum; 8 layers, one per virtual stage.
    "pp4-zbv": (4, {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2,
                    "pipeline_schedule": "zbv"}, {"num_layers": 8}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_TRAINER_LAYOUTS))
def test_trainer_zero_bubble_layout_matches_single_process(name):
    """The whole model (fp32: the linear weights' gradients deferred to W) against the single
    process: losses 1e-6, iteration-0 gradients 1e-5, grad norms, validation loss, replicas."""
    from tests.helpers.parity import check_layout, tiny_spec

    world, parallel, model = _TRAINER_LAYOUTS[name]
    check_layout(tiny_spec(world=world, parallel=parallel, model=model), model)


def _recording_zbv_rank(rank, world_size):
    """ZBV at pp 2, 4 microbatches: every comm.p2p call the executor makes."""
    from workers.parallel import comm

    calls, original = [], comm.p2p

    def recording(sends, recvs, group=None):
        calls.append((tuple(("send", peer) for _, peer, *_ in sends), tuple(("recv", peer) for _, peer, *_ in recvs)))
        return original(sends, recvs, group)

    comm.p2p = recording
    m, layers = 4, _toy_model()
    mine = partition_layers(_L, 2, 2, v_shape=True)[rank]
    inputs, targets = _data(m)
    tables = [schedule(m, 2, 2, s, "zbv") for s in range(2)]
    run_pipeline(tables[rank], stage=rank, pp=2, vpp=2, pp_ranks=(0, 1), v_shape=True,
                 chunks=[torch.nn.Sequential(*(layers[i] for i in idx)) for idx in mine], num_microbatches=m,
                 get_input=lambda mb: inputs[mb], loss_fn=lambda mb, o: _loss(o, targets[mb], m),
                 tensor_shape=(_S, _B, _H), plan=plan_all(tables, 2, True)[rank])
    return calls


@pytest.mark.slow
def test_zbv_executor_posts_exactly_the_proven_plan():
    """What simulate_nccl proves for ZBV (the held-back sends, the receives in sender order) is
    what runs: one comm.p2p batch per non-empty step of plan_all's plan, in order."""
    results = run_ranks(_recording_zbv_rank, 2)
    tables = [schedule(4, 2, 2, s, "zbv") for s in range(2)]
    plans = plan_all(tables, 2, True)
    assert plans != [p2p_plan(t, s, 2, 2, v_shape=True, tables=tables) for s, t in enumerate(tables)]  # sends held
    for rank, plan in enumerate(plans):
        want = [(tuple(("send", op.peer) for op in step.ops if op.kind == "send"),
                 tuple(("recv", op.peer) for op in step.ops if op.kind == "recv")) for step in plan if step.ops]
        assert results[rank] == want
