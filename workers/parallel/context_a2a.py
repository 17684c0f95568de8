"""All-to-all context parallelism (Megatron's ``cp_comm_type: a2a``, DeepSpeed's Ulysses).

Each CP rank holds its load-balanced slice of the sequence (:func:`workers.parallel.context.cp_split`)
with every attention head. One all-to-all turns that into the whole sequence for ``1 / cp`` of the
heads; the rank runs ordinary causal attention on it (the fused kernel, no mask, no blocks), and a
second all-to-all gives every rank its own tokens back with every head. Backward is the same two
all-to-alls in reverse. Each token's q, k, v and output cross the wire once per direction, against
``cp - 1`` K/V blocks per layer for the ring.

Heads go to CP ranks in contiguous groups: rank ``j`` takes query heads ``[j H/cp, (j+1) H/cp)``.
With grouped-query attention the K/V heads split the same way when ``cp`` divides their number,
so every query head meets its own K/V head; otherwise K/V are repeated to one per query head before
the exchange (their gradients summed back), which costs bytes but no correctness. The query heads
(per TP rank) must divide by ``cp``; the spec refuses other layouts before anything starts.
"""

from __future__ import annotations

import torch

from workers.parallel import comm


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s_local, b, h, d]`` (this rank's tokens, every head) -> ``[cp s_local, b, h / cp, d]``:
    every rank's tokens in CP-rank order, this rank's group of heads."""
    cp = comm.world_size(group)
    s, b, h, d = x.shape
    send = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [destination, s, b, h/cp, d]
    return comm.all_to_all(send.reshape(cp * s, b, h // cp, d), group)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[cp s_local, b, h / cp, d]`` -> ``[s_local, b, h, d]``."""
    cp = comm.world_size(group)
    rows, b, hc, d = y.shape
    back = comm.all_to_all(y, group)  # block j: this rank's tokens for head group j
    return back.reshape(cp, rows // cp, b, hc, d).permute(1, 2, 0, 3, 4).reshape(rows // cp, b, cp * hc, d)


def _exchange(forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function whose forward is one all-to-all and whose backward is its inverse."""

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    return Exchange


_SeqToHeads = _exchange(seq_to_heads, heads_to_seq)
_HeadsToSeq = _exchange(heads_to_seq, seq_to_heads)


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, positions: torch.Tensor,
                  attention, ordered: bool = True) -> torch.Tensor:
    """This rank's rows of causal attention over the CP-split sequence, by all-to-all.

    Args:
        q: ``[s_local, b, heads, d]``; k, v: ``[s_local, b, kv_heads, d]`` (this rank's cp_split slice).
        group: the CP group.
        positions: the sequence position of each row of the gathered, rank-major sequence (every
            group member's ``cp_positions`` in group order).
        attention: ``attention(q, k, v)``: causal attention of the gathered rows, in sequence order
            when ``ordered``, else as gathered (an attention that knows the rows' positions: the ring of
            hierarchical CP).

    Returns:
        ``[s_local, b, heads, d]``.
    """
    cp = comm.world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % cp:
        raise ValueError(f"cp_comm_type a2a splits the attention heads over the CP group: {heads} heads per rank "
                         f"do not divide by context_parallel_size {cp}")
    if kv_heads % cp:  # too few K/V heads to split: one per query head
        k, v = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    q, k, v = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    if not ordered:
        return _HeadsToSeq.apply(attention(q, k, v), group)
    order = torch.argsort(positions)  # rank-major row -> sequence order
    out = attention(*(t.index_select(0, order) for t in (q, k, v)))
    return _HeadsToSeq.apply(out.index_select(0, positions), group)
