"""Context parallelism: load-balanced split and CP attention against full causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from workers.parallel import comm
from workers.parallel.attention_kernel import BlockAttention
from workers.parallel.context import (
    causal_attention,
    context_parallel_attention,
    cp_positions,
    cp_split,
    cp_unsplit,
    gather_plan,
)
from workers.parallel.context_layout import attention_blocks
from workers.parallel.context_ring import ring_plans
from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.slow

SEQ, BATCH, DIM = 16, 2, 8
HEAD_CONFIGS = [(4, 2), (4, 4)]  # (num_heads, num_kv_heads): GQA and plain MHA
SCALE = 0.3


def _inputs(num_heads: int, num_kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, num_heads, DIM, generator=g)
    k = torch.randn(SEQ, BATCH, num_kv_heads, DIM, generator=g)
    v = torch.randn(SEQ, BATCH, num_kv_heads, DIM, generator=g)
    dout = torch.randn(SEQ, BATCH, num_heads, DIM, generator=g)
    return q, k, v, dout


def _sdpa_reference(q, k, v, dout, scale):
    """Full causal attention through torch's SDPA with repeated kv heads (independent of raytron)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    out = F.scaled_dot_product_attention(
        to_bhsd(q),
        to_bhsd(k.repeat_interleave(rep, dim=2)),
        to_bhsd(v.repeat_interleave(rep, dim=2)),
        is_causal=True,
        scale=scale,
    ).permute(2, 0, 1, 3)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _OpLog(TorchDispatchMode):
    """Names of the aten ops run under it (to check which attention kernel ran)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


FLASH = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
# Ops that would mean a score block is built outside a fused kernel (einsum lowers to bmm).
SCORE_OPS = {"bmm", "mm", "matmul", "baddbmm", "_softmax", "masked_fill", "logsumexp",
             "_scaled_dot_product_attention_math"}


def _visibility(blocks, n_q: int, n_k: int) -> torch.Tensor:
    """How often each (query, key) pair is attended by ``blocks``."""
    seen = torch.zeros(n_q, n_k, dtype=torch.int)
    for blk in blocks:
        n = blk.q.stop - blk.q.start
        seen[blk.q, blk.k] += torch.ones(n, blk.k.stop - blk.k.start, dtype=torch.int).tril() if blk.causal else 1
    return seen


# ---------------------------------------------------------------- split (single process)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_unsplit_roundtrip_and_positions(cp):
    x = torch.arange(SEQ * 3).reshape(SEQ, 3)
    parts = [cp_split(x, cp, r) for r in range(cp)]
    assert all(p.shape == (SEQ // cp, 3) for p in parts)
    assert torch.equal(cp_unsplit(parts), x)
    for r in range(cp):
        # The split of the positions themselves is what cp_positions must report.
        assert torch.equal(cp_positions(SEQ, cp, r), cp_split(torch.arange(SEQ), cp, r))
    # Every position is held exactly once.
    assert sorted(torch.cat([cp_positions(SEQ, cp, r) for r in range(cp)]).tolist()) == list(range(SEQ))


def test_split_is_load_balanced_and_matches_megatron_layout():
    # seq 8, cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # Causal work (number of visible keys) is equal on every rank.
    work = [int((cp_positions(SEQ, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_split_other_seq_dim():
    x = torch.randn(2, SEQ, 3)
    parts = [cp_split(x, 2, r, seq_dim=1) for r in range(2)]
    assert parts[0].shape == (2, SEQ // 2, 3)
    assert torch.equal(cp_unsplit(parts, seq_dim=1), x)


def test_bad_sequence_length_raises():
    with pytest.raises(ValueError, match=r"12 is not divisible by 2 x context_parallel_size = 8"):
        cp_split(torch.zeros(12, 1), 4, 0)
    with pytest.raises(ValueError, match="not divisible"):
        cp_positions(6, 2, 1)


# ---------------------------------------------------------------- mask-free blocks (pure)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_attention_blocks_cover_the_causal_mask_exactly(cp):
    seq = 8 * cp
    full = torch.arange(seq)
    for r in range(cp):
        q_pos = cp_positions(seq, cp, r)
        for step, blocks in enumerate(ring_plans(seq, cp, r)):
            k_pos = cp_positions(seq, cp, (r - step) % cp)
            assert torch.equal(_visibility(blocks, len(q_pos), len(k_pos)), (k_pos[None] <= q_pos[:, None]).int())
            # Megatron's three cases: one call per ring step, causal only on the diagonal.
            assert len(blocks) == 1 and blocks[0].causal == (step == 0)
        blocks = gather_plan(seq, cp, r)
        assert torch.equal(_visibility(blocks, len(q_pos), seq), (full[None] <= q_pos[:, None]).int())
        assert len(blocks) <= 4


def test_attention_blocks_of_scattered_positions():
    q_pos, k_pos = torch.tensor([0, 1, 5, 6, 7]), torch.tensor([2, 3, 4, 5, 6, 9])
    blocks = attention_blocks(q_pos, k_pos)
    assert torch.equal(_visibility(blocks, 5, 6), (k_pos[None] <= q_pos[:, None]).int())
    assert attention_blocks(torch.tensor([0, 1]), torch.tensor([4, 5])) == ()


@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("cp", [2, 4])
def test_gathered_block_attention_matches_full_without_score_ops(cp, heads):
    """The all_gather variant's compute, rank by rank in one process: fused kernels only."""
    q, k, v, dout = _inputs(*heads)
    ref = _sdpa_reference(q, k, v, dout, SCALE)
    outs, dqs, dk, dv = [], [], torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp):
        q_r = cp_split(q, cp, r).requires_grad_()
        k_r, v_r = k.clone().requires_grad_(), v.clone().requires_grad_()
        with _OpLog() as log:
            out = BlockAttention.apply(q_r, k_r, v_r, gather_plan(SEQ, cp, r), SCALE)
            out.backward(cp_split(dout, cp, r))
        assert FLASH <= log.names and not log.names & SCORE_OPS, log.names
        outs.append(out.detach())
        dqs.append(q_r.grad)
        dk += k_r.grad
        dv += v_r.grad
    for got, want in zip((cp_unsplit(outs), cp_unsplit(dqs), dk, dv), ref):
        _close(got, want)


# ---------------------------------------------------------------- single-process attention


@pytest.mark.parametrize("heads", HEAD_CONFIGS)
def test_causal_attention_matches_sdpa(heads):
    q, k, v, dout = _inputs(*heads)
    ref = _sdpa_reference(q, k, v, dout, SCALE)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v, SCALE)
    out.backward(dout)
    for got, want in zip((out.detach(), q.grad, k.grad, v.grad), ref):
        _close(got, want)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_group_none_is_causal_attention(comm_type):
    q, k, v, dout = _inputs(4, 2)
    ref = _sdpa_reference(q, k, v, dout, 1 / DIM**0.5)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, group=None, ranks=None, comm_type=comm_type)
    out.backward(dout)
    for got, want in zip((out.detach(), q.grad, k.grad, v.grad), ref):
        _close(got, want)


def test_bad_comm_type_and_heads_raise():
    q, k, v, _ = _inputs(4, 2)
    with pytest.raises(ValueError, match="cp_comm_type"):
        context_parallel_attention(q, k, v, group=None, ranks=None, comm_type="ring")
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        causal_attention(q[:, :, :3], k, v)


# ---------------------------------------------------------------- CP attention (multi-process)


WORLD = 4
CP_SIZES = [2, 4]
COMM_TYPES = ["p2p", "all_gather", "a2a"]


def _cp_groups(cp: int) -> list[list[int]]:
    # Strided CP groups (as Megatron's with tp = world / cp) so that global peer ranks differ
    # from CP ranks when cp < world: [0, 2] and [1, 3] for cp 2 on 4 ranks.
    stride = WORLD // cp
    return [list(range(first, WORLD, stride)) for first in range(stride)]


def _cp_rank_fn(rank, world_size, cases):
    """Every (cp, comm_type, case) on one set of ranks: a spawn costs more than the math."""
    results = {}
    for cp in CP_SIZES:
        groups = _cp_groups(cp)
        handles = [dist.new_group(members) for members in groups]  # all ranks, same order
        mine = next(i for i, members in enumerate(groups) if rank in members)
        ranks, group = groups[mine], handles[mine]
        cp_rank = comm.rank(group)
        assert ranks[cp_rank] == rank
        for comm_type in COMM_TYPES:
            for case_index, (q, k, v, dout) in enumerate(cases):
                q, k, v = (cp_split(t, cp, cp_rank).requires_grad_() for t in (q, k, v))
                comm.reset_stats()
                with _OpLog() as log:
                    out = context_parallel_attention(
                        q, k, v, group=group, ranks=ranks, softmax_scale=SCALE, comm_type=comm_type
                    )
                    out.backward(cp_split(dout, cp, cp_rank))
                # numpy, not tensors: torch shares tensors through file descriptors that can
                # vanish with the rank process before the parent reads the result queue.
                tensors = (out.detach(), q.grad, k.grad, v.grad)
                results[cp, comm_type, case_index] = tuple(t.numpy() for t in tensors) + (
                    comm.stats()["other"]["bytes"], sorted(log.names),
                )
        # bf16 compute: q/k/v (and what travels) stay bf16.
        q, k, v, dout = (cp_split(t, cp, cp_rank).bfloat16() for t in cases[0])
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        comm.reset_stats()
        out = context_parallel_attention(q, k, v, group=group, ranks=ranks, softmax_scale=SCALE)
        out.backward(dout)
        tensors = (out.detach(), q.grad, k.grad, v.grad)
        results[cp, "bf16"] = (tuple(t.float().numpy() for t in tensors), {str(t.dtype) for t in tensors},
                               comm.stats()["other"]["bytes"])
    return results


@pytest.fixture(scope="module")
def cp_cases():
    cases = [_inputs(h, hk, seed=i) for i, (h, hk) in enumerate(HEAD_CONFIGS)]
    return cases, run_ranks(_cp_rank_fn, WORLD, args=(cases,))


@pytest.mark.parametrize("case_index", range(len(HEAD_CONFIGS)), ids=["gqa", "mha"])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
@pytest.mark.parametrize("cp", CP_SIZES)
def test_context_parallel_attention_matches_full(cp_cases, cp, comm_type, case_index):
    cases, per_rank = cp_cases
    q, k, v, dout = cases[case_index]
    ref = _sdpa_reference(q, k, v, dout, SCALE)
    key = (cp, comm_type, case_index)
    for members in _cp_groups(cp):
        for field, name in enumerate(["out", "dq", "dk", "dv"]):
            got = cp_unsplit([torch.from_numpy(per_rank[r][key][field]) for r in members])
            torch.testing.assert_close(got, ref[field], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    # Only the kv heads travel: K/V (and dK/dV) blocks are [s_local, b, kv_heads, 2 d].
    kv_bytes = (SEQ // cp) * BATCH * k.shape[2] * 2 * DIM * 4
    if comm_type == "p2p":
        # forward: cp-1 K/V hops; backward: cp-1 K/V hops and cp-1 dK/dV hops (a rank's
        # own block's share stays home): the minimum.
        expected = 3 * (cp - 1) * kv_bytes
    elif comm_type == "a2a":
        # q, k, v and the output cross once each way, (cp-1)/cp of each (a rank's own head group
        # stays home); K/V heads that do not divide by cp travel repeated to one per query head.
        heads = q.shape[2]
        kv_heads = k.shape[2] if k.shape[2] % cp == 0 else heads
        per_token = 2 * heads * DIM + 2 * kv_heads * DIM  # q and out, k and v
        expected = 2 * (cp - 1) * (SEQ // cp) * BATCH * per_token * 4 // cp
    else:
        # all-gather plus reduce-scatter of the whole sequence's K/V, (cp-1)/cp each.
        expected = 2 * (cp - 1) * kv_bytes
    assert [per_rank[r][key][4] for r in range(WORLD)] == [expected] * WORLD
    # Fused kernels only: no score block is built from matmuls, no masked math fallback.
    for r in range(WORLD):
        ops = set(per_rank[r][key][5])
        assert FLASH <= ops and not ops & SCORE_OPS, ops


@pytest.mark.parametrize("cp", CP_SIZES)
def test_bf16_ring_keeps_the_compute_dtype_on_the_wire(cp_cases, cp):
    cases, per_rank = cp_cases
    ref = _sdpa_reference(*(t.bfloat16().double() for t in cases[0]), SCALE)
    for members in _cp_groups(cp):
        for field, name in enumerate(["out", "dq", "dk", "dv"]):
            got = cp_unsplit([torch.from_numpy(per_rank[r][cp, "bf16"][0][field]) for r in members])
            # bf16 inputs and bf16 results: a few bf16 ulps of the values (|x| ~ 1).
            torch.testing.assert_close(got.double(), ref[field], atol=3e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
    k = cases[0][1]
    kv_bytes = (SEQ // cp) * BATCH * k.shape[2] * 2 * DIM * 2  # bf16
    for r in range(WORLD):
        assert per_rank[r][cp, "bf16"][1] == {"torch.bfloat16"}
        assert per_rank[r][cp, "bf16"][2] == 3 * (cp - 1) * kv_bytes


def _ranks_mismatch_fn(rank, world_size):
    group = dist.new_group([0, 1])
    q = torch.zeros(4, 1, 2, 4)
    try:
        context_parallel_attention(q, q, q, group=group, ranks=[1, 0])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_wrong_ranks_order_raises():
    messages = run_ranks(_ranks_mismatch_fn, 2)
    assert all("CP-rank order" in m for m in messages), messages


def test_cp_memory_bench_peak_table(capsys):
    """bench/cp_memory.py's peak/time table runs end to end (tiny sequence, one iteration)."""
    from bench import cp_memory

    cp_memory.main(["--seqs", "64", "--iters", "1", "--all-gather", "--no-saved"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("64 ")]
    assert [(r[1], r[2]) for r in rows] == [("1", "-"), ("2", "p2p"), ("2", "all_gather")]
    assert all(float(r[3]) > 0 for r in rows) and rows[0][-4:] == ["1.000"] * 4
