"""Ring attention: causal attention over the CP group with K/V blocks passed around a ring.

Each CP rank holds the queries and keys/values of its own (load-balanced) slice of the
sequence. At step ``j`` rank ``r`` attends its queries against the K/V block that started
at CP rank ``(r - j) mod cp`` while that block already travels on to rank ``r + 1`` and the
next one arrives from ``r - 1`` (the exchange is posted before the compute, so the two
overlap). Partial results are merged with the log-sum-exp rule of online softmax.

The backward pass recomputes each block's probabilities from the saved q, k, v, output and
log-sum-exp (FlashAttention's recipe) and sends, next to the K/V block, the dK/dV
accumulated for it so far; after ``cp`` steps every block's gradient is back at its owner,
as in Megatron / TransformerEngine ring attention.

Only the ``num_kv_heads`` heads travel: grouped-query attention is computed by viewing the
queries as ``[s, b, num_kv_heads, group, head_dim]`` instead of repeating K/V.

Internal layouts: queries/outputs ``[s, b, kv_heads, group, d]``; K/V travel as one tensor
``[s, b, kv_heads, 2 d]`` (k and v concatenated on the last dim); log-sum-exp
``[b, kv_heads, group, s]``.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from workers.parallel import comm
from workers.parallel.context_layout import cp_positions

def _group_heads(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    s, b, h, d = x.shape
    return x.reshape(s, b, num_kv_heads, h // num_kv_heads, d)


def block_plan(q_pos: torch.Tensor, k_pos: torch.Tensor):
    """Which query rows and key columns of a block take part, and the causal mask among them.

    Args:
        q_pos: global positions of the queries, ``[s_q]``.
        k_pos: global positions of the keys, ``[s_k]``.

    Returns:
        ``None`` when no query sees any key (the block is skipped), else
        ``(rows, cols, mask)``: index tensors of the participating queries and keys, and the
        ``[len(rows), len(cols)]`` boolean visibility mask, or ``None`` when every selected
        key is visible to every selected query (no masking needed).
    """
    mask = k_pos[None, :] <= q_pos[:, None]
    rows = mask.any(dim=1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return None
    cols = mask.any(dim=0).nonzero().squeeze(1)
    sub = mask.index_select(0, rows).index_select(1, cols)
    return rows, cols, (None if bool(sub.all()) else sub)


@functools.lru_cache(maxsize=64)
def ring_plans(seq_len: int, cp: int, cp_rank: int, device: str = "cpu") -> tuple:
    """:func:`block_plan` of every ring step of ``cp_rank``, computed once per layout.

    Positions are static, so the plans are too: working them out on the host once (rather
    than per step, where ``nonzero`` and ``all`` would each wait for the device) removes the
    host syncs from the ring. Step ``j`` pairs this rank's queries with the K/V block that
    started at CP rank ``cp_rank - j``.
    """
    positions = [cp_positions(seq_len, cp, r) for r in range(cp)]
    plans = []
    for step in range(cp):
        plan = block_plan(positions[cp_rank], positions[(cp_rank - step) % cp])
        if plan is not None:
            rows, cols, mask = plan
            plan = tuple(t if t is None else t.to(device) for t in (rows, cols, mask))
        plans.append(plan)
    return tuple(plans)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask) -> torch.Tensor:
    scores = torch.einsum("qbkgd,sbkd->bkgqs", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _block_forward(q, k, v, scale, mask):
    """Normalised block output ``[nq, b, kv, g, d]`` and its log-sum-exp ``[b, kv, g, nq]``."""
    scores = _scores(q, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("bkgqs,sbkd->qbkgd", probs, v), lse


def _block_backward(q, k, v, dout, lse, delta, scale, mask):
    """dq, dk, dv of one block given the *final* row log-sum-exp and delta = rowsum(dO * O)."""
    probs = torch.exp(_scores(q, k, scale, mask) - lse[..., None])
    dv = torch.einsum("bkgqs,qbkgd->sbkd", probs, dout)
    dprobs = torch.einsum("qbkgd,sbkd->bkgqs", dout, v)
    dscores = probs * (dprobs - delta[..., None]) * scale
    dq = torch.einsum("bkgqs,sbkd->qbkgd", dscores, k)
    dk = torch.einsum("bkgqs,qbkgd->sbkd", dscores, q)
    return dq, dk, dv


def _merge(out, lse, rows, blk_out, blk_lse) -> None:
    """Fold a block's normalised output into the running output (online softmax)."""
    old_lse = lse.index_select(-1, rows)
    new_lse = torch.logaddexp(old_lse, blk_lse)
    # Weights move from [b, kv, g, nq] to the output layout [nq, b, kv, g, 1].
    w_old = torch.exp(old_lse - new_lse).permute(3, 0, 1, 2)[..., None]
    w_blk = torch.exp(blk_lse - new_lse).permute(3, 0, 1, 2)[..., None]
    out.index_copy_(0, rows, out.index_select(0, rows) * w_old + blk_out * w_blk)
    lse.index_copy_(-1, rows, new_lse)


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
        num_kv_heads, d = k.shape[2], k.shape[3]
        nxt, prv = ranks[(cp_rank + 1) % cp], ranks[(cp_rank - 1) % cp]
        qg = _group_heads(q, num_kv_heads)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[1:4] + qg.shape[:1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()
        for step in range(cp):
            works, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, nxt, prv, group)
            plan = plans[step]
            if plan is not None:
                rows, cols, mask = plan
                kb, vb = kv.index_select(0, cols).split(d, dim=-1)
                blk_out, blk_lse = _block_forward(qg.index_select(0, rows), kb, vb, scale, mask)
                _merge(out, lse, rows, blk_out, blk_lse)
            for work in works:
                work.wait()
            kv = incoming if incoming is not None else kv
        out = out.reshape(q.shape)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.plans, ctx.cp_rank, ctx.ranks, ctx.group = scale, plans, cp_rank, ranks, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, plans, cp_rank, ranks, group = ctx.scale, ctx.plans, ctx.cp_rank, ctx.ranks, ctx.group
        cp = len(ranks)
        num_kv_heads, d = k.shape[2], k.shape[3]
        nxt, prv = ranks[(cp_rank + 1) % cp], ranks[(cp_rank - 1) % cp]
        qg = _group_heads(q, num_kv_heads)
        dog = _group_heads(dout.contiguous(), num_kv_heads)
        delta = (dog * _group_heads(out, num_kv_heads)).sum(-1).permute(1, 2, 3, 0)
        dq = torch.zeros_like(qg)
        kv = torch.cat([k, v], dim=-1).contiguous()
        # dK/dV of the block held at a step travel one step behind it: they are posted after
        # the block's compute and waited for only after the next block's compute.
        pending, dkv_in, dkv_sent, own_dkv = [], None, None, None
        for step in range(cp):
            works, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, nxt, prv, group)
            dkv = torch.zeros_like(kv)
            plan = plans[step]
            if plan is not None:
                rows, cols, mask = plan
                kb, vb = kv.index_select(0, cols).split(d, dim=-1)
                dq_b, dk_b, dv_b = _block_backward(
                    qg.index_select(0, rows), kb, vb, dog.index_select(0, rows),
                    lse.index_select(-1, rows), delta.index_select(-1, rows), scale, mask,
                )
                dq.index_add_(0, rows, dq_b)
                dkv.index_add_(0, cols, torch.cat([dk_b, dv_b], dim=-1))
            for work in works + pending:
                work.wait()
            if step == 0:
                own_dkv = dkv  # our own block's share never needs to leave this rank
            else:
                if dkv_in is not None:
                    # What the ranks before us accumulated for this same block.
                    dkv += dkv_in
                dkv_in, dkv_sent = torch.empty_like(kv), dkv
                pending = _exchange(dkv_sent, dkv_in, nxt, prv, group)
            kv = incoming if incoming is not None else kv
        for work in pending:
            work.wait()
        # After cp - 1 hops the block that arrives is our own, with every other rank's share.
        dk, dv = (own_dkv + dkv_in).split(d, dim=-1)
        return dq.reshape(q.shape), dk.contiguous(), dv.contiguous(), None, None, None, None, None
