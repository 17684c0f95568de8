"""MoE with expert parallelism (EP) and expert tensor parallelism (ETP), against a dense,
single-process reference that runs every expert on every token and picks the outputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import moe_bench
from bench.moe_bench import HostSyncCounter, loop_swiglu_experts
from workers.parallel import comm
from workers.parallel.expert import MoELayer, SwiGLUExperts, TopKRouter
from workers.parallel.grouped_gemm import ExpertRuns, grouped_mm_supported, swiglu_experts
from workers.parallel.moe_dispatch import AllToAllDispatcher
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.slow

E, H, FFN, TOPK, DEAD = 4, 6, 8, 2, 3  # expert DEAD never receives a token (crafted router)


# ---------------------------------------------------------------------------------------------
# Independent reference and test data
# ---------------------------------------------------------------------------------------------


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g) * 0.5
    # Feature 0 of every token is >= 1 (see _tokens), so this row's logit is <= -100: never top-k.
    router[DEAD] = 0.0
    router[DEAD, 0] = -100.0
    wg = torch.randn(E, FFN, H, generator=g) * 0.4
    wu = torch.randn(E, FFN, H, generator=g) * 0.4
    wd = torch.randn(E, H, FFN, generator=g) * 0.4
    return router, wg, wu, wd


def _tokens(seq: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, H, generator=g)
    x[..., 0] = x[..., 0].abs() + 1.0
    return x, torch.randn(seq, batch, H, generator=g)


def _ref_aux(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    idx = torch.topk(logits, TOPK, dim=-1).indices
    f = torch.stack([(idx == e).sum() for e in range(E)]).float() / idx.numel()
    return coeff * E * (f * torch.softmax(logits, -1).mean(0)).sum()


def _ref_moe(x: torch.Tensor, router, wg, wu, wd) -> torch.Tensor:
    """Dense: every expert on every token, then pick the top-k by index and mix by gates."""
    logits = x @ router.t()
    top, idx = torch.topk(logits, TOPK, dim=-1)
    gates = torch.softmax(top, -1)
    every = torch.stack([(F.silu(x @ wg[e].t()) * (x @ wu[e].t())) @ wd[e].t() for e in range(E)])  # [E, T, h]
    picked = every[idx, torch.arange(x.shape[0]).unsqueeze(1)]  # [T, k, h]
    return (picked * gates.unsqueeze(-1)).sum(1)


# ---------------------------------------------------------------------------------------------
# Group layout: global rank = (edp_rank * ep + ep_rank) * etp + etp_rank (Megatron's tp-ep-dp)
# ---------------------------------------------------------------------------------------------


def _coords(rank: int, ep: int, etp: int) -> tuple[int, int, int]:
    return rank // (ep * etp), (rank // etp) % ep, rank % etp


def _make_groups(world: int, ep: int, etp: int):
    """Every rank creates every group in the same order; returns this rank's (ep, etp) groups."""
    me = dist.get_rank()
    ep_group = etp_group = None
    for base in range(0, world, ep * etp):
        for j in range(etp):  # EP group: same edp and etp coordinates, e.g. [0,2],[1,3]
            ranks = [base + i * etp + j for i in range(ep)]
            grp = dist.new_group(ranks)
            ep_group = grp if me in ranks else ep_group
        for i in range(ep):  # ETP group: consecutive ranks, e.g. [0,1],[2,3]
            ranks = [base + i * etp + j for j in range(etp)]
            grp = dist.new_group(ranks)
            etp_group = grp if me in ranks else etp_group
    return ep_group, etp_group


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


def _crafted_routing(rank: int):
    """Rank r holds 2r tokens (rank 0 none) whose feature 0 is a global token id; expert 1 is unused."""
    n = 2 * rank
    ids = torch.arange(n) + rank * 100
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(rank))
    x[:, 0] = ids.float()
    choices = torch.tensor([[0, 2], [3, 0], [2, 3], [0, 3]])
    idx = choices[(ids + rank) % 4]
    gates = torch.rand(n, TOPK, generator=torch.Generator().manual_seed(50 + rank))
    return x, idx, gates


def _fake_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    return (e + 1) * rows + e


def _dispatch_worker(rank, world, ep, etp):
    ep_group, etp_group = _make_groups(world, ep, etp)
    _, ep_rank, _ = _coords(rank, ep, etp)
    x, idx, gates = _crafted_routing(rank)
    x.requires_grad_(True)
    gates.requires_grad_(True)
    disp = AllToAllDispatcher(E, ep_group, etp_group)
    expert_in, expert_runs, plan = disp.dispatch(x, idx)
    assert expert_runs.counts_device.tolist() == expert_runs.counts
    runs = torch.split(expert_in, expert_runs.counts)
    ids = [sorted(r[:, 0].tolist()) for r in runs]
    # Each ETP rank supplies 1/etp of the output, as an ffn slice would.
    out = torch.cat([_fake_expert(ep_rank * disp.num_local_experts + i, r) / etp for i, r in enumerate(runs)])
    y = disp.combine(out, gates, plan)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(70 + rank))
    (y * w).sum().backward()
    return ids, y.detach(), x.grad, gates.grad


@pytest.mark.parametrize("ep,etp", [(4, 1), (2, 2)])
def test_dispatcher_matches_local_reference(ep, etp):
    world = ep * etp
    results = run_ranks(_dispatch_worker, world, args=(ep, etp))
    data = [_crafted_routing(r) for r in range(world)]
    for rank, (ids, y, gx, gg) in enumerate(results):
        _, ep_rank, _ = _coords(rank, ep, etp)
        x, idx, gates = data[rank]
        x, gates = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
        every = torch.stack([_fake_expert(e, x) for e in range(E)])
        ref = (every[idx, torch.arange(x.shape[0]).unsqueeze(1)] * gates.unsqueeze(-1)).sum(1)
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(70 + rank))
        (ref * w).sum().backward()
        torch.testing.assert_close(y, ref.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gg, gates.grad, atol=1e-5, rtol=1e-5)
        # Every local expert saw exactly the tokens, from all ranks, that chose it (expert 1: none).
        for i, got in enumerate(ids):
            e = ep_rank * (E // ep) + i
            want = sorted(t for d in data for t, row in zip(d[0][:, 0].tolist(), d[1].tolist()) if e in row)
            assert got == want, (rank, e)
        assert all(not got for i, got in enumerate(ids) if ep_rank * (E // ep) + i == 1)


# ---------------------------------------------------------------------------------------------
# Whole layer, distributed
# ---------------------------------------------------------------------------------------------

S_LOCAL, B, COEFF = 3, 2, 0.1


def _layer_worker(rank, world, ep, etp):
    ep_group, etp_group = _make_groups(world, ep, etp)
    router, wg, wu, wd = _weights()
    x_full, g_full = _tokens(world * S_LOCAL, B)
    rows = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    layer = MoELayer.from_full(
        router, wg, wu, wd, topk=TOPK, ep_group=ep_group, etp_group=etp_group,
        aux_loss_coeff=COEFF, sequence_parallel=True,
    )
    x = x_full[rows].clone().requires_grad_(True)
    y, aux = layer(x)
    ((y * g_full[rows]).sum() + aux).backward()
    ex = layer.experts
    assert layer.router.weight.sequence_parallel and all(p.is_expert for p in ex.parameters())
    return y.detach(), aux.detach(), x.grad, layer.router.weight.grad, [p.grad for p in (ex.w_gate, ex.w_up, ex.w_down)]


@pytest.mark.parametrize("ep,etp,world", [(2, 1, 2), (4, 1, 4), (1, 2, 2), (2, 2, 4), (2, 1, 4)])
def test_moe_layer_matches_single_process(ep, etp, world):
    """(2, 1, 4) has expert-dp 2: expert grads are summed over it, as the trainer does."""
    results = run_ranks(_layer_worker, world, args=(ep, etp))
    router, wg, wu, wd = (t.clone().requires_grad_(True) for t in _weights())
    x_full, g_full = _tokens(world * S_LOCAL, B)
    x = x_full.clone().requires_grad_(True)
    y_ref = _ref_moe(x.reshape(-1, H), router, wg, wu, wd).view(x.shape)
    logits = (x @ router.t()).view(world, S_LOCAL * B, E)
    auxes = [_ref_aux(logits[r], COEFF) for r in range(world)]
    ((y_ref * g_full).sum() + sum(auxes)).backward()
    assert wg.grad[DEAD].abs().sum() == 0  # the reference agrees the dead expert got nothing

    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), y_ref.detach(), **close)
    torch.testing.assert_close(torch.stack([r[1] for r in results]), torch.stack(auxes).detach(), **close)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), x.grad, **close)
    torch.testing.assert_close(sum(r[3] for r in results), router.grad, **close)
    full = [torch.zeros_like(w) for w in (wg, wu, wd)]
    el, fl = E // ep, FFN // etp
    for rank, r in enumerate(results):
        _, ep_rank, etp_rank = _coords(rank, ep, etp)
        es, fs = slice(ep_rank * el, (ep_rank + 1) * el), slice(etp_rank * fl, (etp_rank + 1) * fl)
        full[0][es, fs] += r[4][0]
        full[1][es, fs] += r[4][1]
        full[2][es, :, fs] += r[4][2]
    for got, w in zip(full, (wg, wu, wd)):
        torch.testing.assert_close(got, w.grad, **close)


# ---------------------------------------------------------------------------------------------
# Single process (group=None), aux loss, validation
# ---------------------------------------------------------------------------------------------


def test_group_none_matches_reference():
    router, wg, wu, wd = _weights()
    layer = MoELayer.from_full(router, wg, wu, wd, topk=TOPK)
    x_full, g = _tokens(5, 3)
    x = x_full.clone().requires_grad_(True)
    y, aux = layer(x)
    (y * g).sum().backward()
    assert aux.item() == 0.0 and layer.router.weight.sequence_parallel is False

    refs = [t.clone().requires_grad_(True) for t in (x_full, router, wg, wu, wd)]
    y_ref = _ref_moe(refs[0].reshape(-1, H), *refs[1:]).view(x.shape)
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref.detach(), atol=1e-5, rtol=1e-5)
    ex = layer.experts
    mine = [x.grad, layer.router.weight.grad, ex.w_gate.grad, ex.w_up.grad, ex.w_down.grad]
    for got, ref in zip(mine, refs):
        torch.testing.assert_close(got, ref.grad, atol=1e-5, rtol=1e-5)


def test_aux_loss_by_hand():
    # Three tokens, three experts, top-2. Identity router: logits are the tokens themselves.
    router = TopKRouter(torch.eye(3), topk=2, aux_loss_coeff=0.5)
    x = torch.tensor([[3.0, 2.0, 0.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])
    gates, idx, aux = router(x)
    assert idx.tolist() == [[0, 1], [2, 1], [0, 2]]
    e = math.exp
    assert gates[0].tolist() == pytest.approx([e(3) / (e(3) + e(2)), e(2) / (e(3) + e(2))])
    # f: choices per expert / 6 = [2, 2, 2] / 6; P_e: mean softmax probability of e.
    rows = [[e(v) / sum(e(u) for u in r) for v in r] for r in x.tolist()]
    p = [sum(r[j] for r in rows) / 3 for j in range(3)]
    want = 0.5 * 3 * sum(fe * pe for fe, pe in zip([2 / 6, 2 / 6, 2 / 6], p))
    assert aux.item() == pytest.approx(want, rel=1e-6)
    # Unbalanced: all tokens prefer experts 0 and 1.
    x2 = torch.tensor([[5.0, 4.0, 0.0], [4.0, 5.0, 0.0]])
    _, _, aux2 = router(x2)
    rows = [[e(v) / sum(e(u) for u in r) for v in r] for r in x2.tolist()]
    p = [sum(r[j] for r in rows) / 2 for j in range(3)]
    assert aux2.item() == pytest.approx(0.5 * 3 * (0.5 * p[0] + 0.5 * p[1]), rel=1e-6)


def test_validation_errors(fake_group_sizes):
    router, wg, wu, wd = _weights()
    with pytest.raises(ValueError, match=r"moe_router_topk \(5\).*num_moe_experts \(4\)"):
        TopKRouter(router, topk=5)
    with pytest.raises(ValueError, match=r"w_down must be"):
        SwiGLUExperts(wg, wu, wd.transpose(1, 2))
    with pytest.raises(ValueError, match=r"num_moe_experts \(3\).*expert_model_parallel_size"):
        AllToAllDispatcher(3, _FakeGroup(2))
    with pytest.raises(ValueError, match=r"ffn_hidden_size \(8\).*expert_tensor_parallel_size \(3\)"):
        SwiGLUExperts(wg, wu, wd, None, _FakeGroup(3))
    with pytest.raises(ValueError, match=r"num_moe_experts \(4\).*expert_model_parallel_size \(3\)"):
        SwiGLUExperts(wg, wu, wd, _FakeGroup(3), None)
    layer = MoELayer.from_full(router, wg, wu, wd, topk=TOPK)
    with pytest.raises(ValueError, match="must agree"):
        MoELayer(TopKRouter(router[:2], 1), layer.experts, layer.dispatcher)


class _FakeGroup:
    """Just enough of a group for constructors that only ask its size and rank."""

    def __init__(self, size: int):
        self.size = size


@pytest.fixture
def fake_group_sizes(monkeypatch):
    from workers.parallel import comm

    real_size, real_rank = comm.world_size, comm.rank
    monkeypatch.setattr(comm, "world_size", lambda g: g.size if isinstance(g, _FakeGroup) else real_size(g))
    monkeypatch.setattr(comm, "rank", lambda g: 0 if isinstance(g, _FakeGroup) else real_rank(g))


# ---------------------------------------------------------------------------------------------
# Grouped GEMM against the per-expert loop; host syncs per layer
# ---------------------------------------------------------------------------------------------


def _expert_case(counts: list[int], dtype=torch.float32, device="cpu", h=H, f=FFN):
    g = torch.Generator().manual_seed(sum(counts) + len(counts))
    e = len(counts)
    ws = [torch.randn(e, f, h, generator=g), torch.randn(e, f, h, generator=g), torch.randn(e, h, f, generator=g)]
    x = torch.randn(sum(counts), h, generator=g)
    grad = torch.randn(sum(counts), h, generator=g)
    ws, x, grad = ([w.to(device, dtype).requires_grad_(True) for w in ws], x.to(device, dtype).requires_grad_(True),
                   grad.to(device, dtype))
    runs = ExpertRuns(counts, torch.tensor(counts, device=device))
    return x, ws, grad, runs


def _run_experts(fn, x, ws, grad, runs, **kw):
    x, ws = x.detach().clone().requires_grad_(True), [w.detach().clone().requires_grad_(True) for w in ws]
    y = fn(x, *ws, runs, **kw)
    y.backward(grad)
    return [y.detach(), x.grad] + [w.grad for w in ws]


@pytest.mark.parametrize("counts", [[3, 2, 5, 1], [3, 0, 5, 1], [2, 2, 2, 2], [0, 0, 7, 0], [0, 0, 0, 0], [1]],
                         ids=["uneven", "uneven-with-empty", "balanced", "one-expert", "no-rows", "single"])
def test_grouped_experts_match_loop(counts):
    """The padded-bmm path (what runs on CPU) against the per-expert loop it replaced.

    Per row the same products are summed, but bmm and mm may block the reductions
    differently (seen: 1.3e-6 on a weight gradient of magnitude ~0.3 here; 0 at the bench's
    shapes), so this uses the file's 1e-5, not bit equality."""
    case = _expert_case(counts)
    assert not grouped_mm_supported(case[0], *case[1])  # CPU fp32: the bmm path
    got = _run_experts(swiglu_experts, *case)
    want = _run_experts(loop_swiglu_experts, *case)
    for g, w in zip(got, want):
        assert g is not None and g.shape == w.shape  # every weight gets a gradient, zero if unused
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    for e, c in enumerate(counts):
        if c == 0:
            assert all(gw[e].abs().sum() == 0 for gw in got[2:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="torch._grouped_mm needs CUDA sm90+")
def test_grouped_mm_matches_bmm_path_on_cuda():
    """bf16 on sm90+: ``_grouped_mm`` is selected, and agrees with the bmm path within bf16."""
    case = _expert_case([40, 0, 24, 64], torch.bfloat16, "cuda", h=64, f=128)
    assert grouped_mm_supported(case[0], *case[1])
    got = _run_experts(swiglu_experts, *case, use_grouped_mm=True)
    want = _run_experts(swiglu_experts, *case, use_grouped_mm=False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


def _count_layer_syncs(ep_group=None, etp_group=None, tokens: int = 12):
    """(forward, backward) host syncs of one MoE layer over these groups."""
    router, wg, wu, wd = _weights()
    layer = MoELayer.from_full(router, wg, wu, wd, topk=TOPK, ep_group=ep_group, etp_group=etp_group,
                               aux_loss_coeff=COEFF)
    x, g = _tokens(tokens, 1, seed=1 + comm.rank(ep_group))
    x.requires_grad_(True)
    with HostSyncCounter() as fwd:
        y, aux = layer(x)
    with HostSyncCounter() as bwd:
        ((y * g).sum() + aux).backward()
    return fwd.events, bwd.events


def _sync_worker(rank, world, ep, etp):
    return _count_layer_syncs(*_make_groups(world, ep, etp))


@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (2, 2)])
def test_one_host_sync_per_layer(ep, etp):
    """The dispatcher's single ``tolist`` (split sizes and per-expert counts together) is the
    only sync of a layer's forward; the backward has none."""
    world = ep * etp
    results = [_count_layer_syncs()] if world == 1 else run_ranks(_sync_worker, world, args=(ep, etp))
    for fwd, bwd in results:
        assert fwd == ["tolist"] and bwd == [], (fwd, bwd)


def test_sync_counter_sees_syncs():
    """The counter itself: each kind of sync it claims to count is counted once."""
    t = torch.arange(4)
    with HostSyncCounter() as c:
        t.tolist()
        t[1].item()
        bool(t[2] > 0)
        t.nonzero()
        torch.repeat_interleave(t, t)
        torch.repeat_interleave(t, t, output_size=6)  # sized by the caller: no sync
        t.numpy()
    assert c.events == ["tolist", "_local_scalar_dense", "_local_scalar_dense", "nonzero", "repeat_interleave",
                        "numpy"]


def test_moe_bench_smallest_case():
    """bench/moe_bench.py runs, both paths agree, and each layer syncs once (experts: never)."""
    r = moe_bench.compare(64, torch.float32, 1, num_experts=4, topk=2, hidden=16, ffn=32)
    for path in ("loop", "grouped"):
        assert (r[path]["layer_syncs"], r[path]["experts_syncs"]) == (1, 0), r[path]["sync_events"]
        assert r[path]["layer_ms"] > 0 and r[path]["experts_min_ms"] > 0
    assert r["rel_diff_y"] < 1e-6 and r["rel_diff_grads"] < 1e-5
