"""Ring attention: causal attention over the CP group with K/V blocks passed around a ring.

Each CP rank holds the queries and keys/values of its own (load-balanced) slice of the
sequence. At step ``j`` rank ``r`` attends its queries against the K/V block that started
at CP rank ``(r - j) mod cp`` while that block already travels on to rank ``r + 1`` and the
next one arrives from ``r - 1`` (the exchange is posted before the compute, so the two
overlap).

Each step is one fused flash-kernel call (:mod:`workers.parallel.attention_kernel`): with
the load-balanced layout the step's visible part is a single mask-free block
(:func:`workers.parallel.context_layout.attention_blocks`: causal on the diagonal step,
fully visible otherwise), so no score block is ever materialised. The kernel returns the
block's log-sum-exp, by which the steps' outputs are merged (online softmax) into an fp32
running output.

The backward pass runs the kernel's backward per step with the merged output and
log-sum-exp (FlashAttention's recipe) and sends, next to the K/V block, the dK/dV
accumulated for it so far; after ``cp`` steps every block's gradient is back at its owner,
as in Megatron / TransformerEngine ring attention.

q/k/v, K/V on the wire and dK/dV on the wire are in the compute dtype; the running output,
the log-sum-exp and the local dQ / dK/dV sums are fp32 (float64 for float64 q/k/v, and then
dK/dV travel in float64: every step's share is summed once, rounded once). Only the ``num_kv_heads`` heads
travel. K/V travel as one tensor ``[s, b, kv_heads, 2 d]`` (k and v concatenated on the last
dim).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from workers.parallel import comm
from workers.parallel.attention_kernel import acc_dtype, backward_blocks, forward_blocks
from workers.parallel.context_layout import rank_positions, row_blocks


@functools.lru_cache(maxsize=64)
def ring_plans(seq_len: int, cp: int, cp_rank: int, docs: tuple | None = None) -> tuple:
    """The :func:`attention_blocks` of every ring step of ``cp_rank``, worked out once per layout.

    Positions are static, so the plans are too, and the ring needs no host syncs. Step ``j``
    pairs this rank's queries with the K/V block that started at CP rank ``cp_rank - j``; an
    empty step (nothing visible) is skipped. ``docs``: packed documents, each split over the ranks
    (:func:`workers.parallel.context_layout.document_split`).
    """
    def held(r):
        return lambda cu: rank_positions(seq_len, cp, r, cu)

    return tuple(row_blocks(docs, held(cp_rank), held((cp_rank - step) % cp)) for step in range(cp))


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group):
    """Send to the next rank and receive from the previous one in one batch; returns the works.

    No tags (NCCL has none): every rank posts its exchanges in the same order (K/V of step
    j, then the dK/dV of step j), so each pair's messages match in posting order.
    """
    return comm.p2p([(send, nxt)], [(recv, prv)], group)


class RingAttention(torch.autograd.Function):
    """Causal attention across the CP ring; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, plans: Sequence, cp_rank: int, ranks, group):
        cp = len(ranks)
        assert cp > 1, "the ring needs at least two ranks; cp == 1 is plain causal attention"
        d = k.shape[3]
        nxt, prv = ranks[(cp_rank + 1) % cp], ranks[(cp_rank - 1) % cp]
        acc = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        lse = torch.full((q.shape[1], q.shape[2], q.shape[0]), float("-inf"), dtype=acc.dtype, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        for step in range(cp):
            works, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, nxt, prv, group)
            kb, vb = kv.split(d, dim=-1)
            forward_blocks(q, kb, vb, plans[step], scale, acc, lse)
            for work in works:
                work.wait()
            kv = incoming if incoming is not None else kv
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.plans, ctx.cp_rank, ctx.ranks, ctx.group = scale, plans, cp_rank, ranks, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, plans, cp_rank, ranks, group = ctx.scale, ctx.plans, ctx.cp_rank, ctx.ranks, ctx.group
        cp = len(ranks)
        d = k.shape[3]
        nxt, prv = ranks[(cp_rank + 1) % cp], ranks[(cp_rank - 1) % cp]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        kv = torch.cat([k, v], dim=-1)
        # dK/dV of the block held at a step travel one step behind it: they are posted after
        # the block's compute and waited for only after the next block's compute.
        pending, dkv_in, dkv_sent, own_dkv = [], None, None, None
        for step in range(cp):
            works, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, nxt, prv, group)
            dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=kv.device)
            kb, vb = kv.split(d, dim=-1)
            dk_b, dv_b = dkv.split(d, dim=-1)
            backward_blocks(dout, q, kb, vb, out, lse, plans[step], scale, dq, dk_b, dv_b)
            for work in works + pending:
                work.wait()
            if step == 0:
                own_dkv = dkv  # our own block's share never needs to leave this rank
            else:
                if dkv_in is not None:
                    # What the ranks before us accumulated for this same block, summed in fp32.
                    dkv += dkv_in
                dkv_in, dkv_sent = torch.empty_like(kv), dkv.to(kv.dtype)
                pending = _exchange(dkv_sent, dkv_in, nxt, prv, group)
            kv = incoming if incoming is not None else kv
        for work in pending:
            work.wait()
        # After cp - 1 hops the block that arrives is our own, with every other rank's share.
        dk, dv = own_dkv.add_(dkv_in).split(d, dim=-1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
