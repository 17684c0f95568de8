"""Context parallelism (CP): load-balanced sequence split and causal attention over the CP group.

With causal attention the last tokens of a sequence attend to far more keys than the first
ones, so cutting the sequence into ``cp`` contiguous pieces would leave the last CP rank with
most of the work. Megatron's remedy, used here: cut the sequence into ``2 cp`` equal chunks
and give CP rank ``i`` chunks ``i`` and ``2 cp - 1 - i`` (one early, one late), concatenated.
Every rank then does the same amount of attention work.

Only attention mixes tokens, so it is the only layer that needs the other ranks' data. Two
ways to provide it (Megatron's ``cp_comm_type``):

* ``"p2p"``: ring attention (:mod:`workers.parallel.context_ring`), K/V blocks circulate
  around the group while each rank computes against the block it holds.
* ``"all_gather"``: every rank gathers the whole sequence's K/V (backward: reduce-scatter of
  dK/dV) and attends its local queries against it, as the fused-kernel blocks of
  :func:`~workers.parallel.context_layout.attention_blocks` (causal and fully visible
  pieces, merged by log-sum-exp) rather than one call with a mask, which no fused kernel
  takes (the math fallback would materialise the ``[s_local, s]`` scores).
* ``"a2a"``: all-to-all from sequence shards to head shards and back
  (:mod:`workers.parallel.context_a2a`): each rank attends the whole sequence for its share of the
  heads.
* ``"a2a+p2p"``: the all-to-all inside groups of consecutive CP ranks (a node), then the ring
  across those groups for the heads each rank got (Megatron's hierarchical CP).

Packed documents (``docs``: each row's ``cu_seqlens``) are honoured by every comm type: each
document is split over the ranks (:func:`workers.parallel.context_layout.document_split`, Megatron's
THD split) and the blocks are planned on each row's positions, cut at every document start.

Both keep q/k/v in the compute dtype, on the wire and in the kernel
(:mod:`workers.parallel.attention_kernel`); only the merged output and log-sum-exp are fp32.
Under ``main_grads_dtype: fp64`` the whole core runs in float64 (``dtype``), the single
process's too, and rounds to the compute dtype once: its output and q/k/v gradients are then
the single process's to the last fp32 bit, however CP cuts the keys.

Layouts are Megatron's ``[seq, batch, ...]``: q ``[s_local, b, num_heads, head_dim]``, k and v
``[s_local, b, num_kv_heads, head_dim]``; query head ``h`` uses kv head
``h // (num_heads // num_kv_heads)`` (grouped-query attention).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
import torch.distributed as dist

from workers.parallel import comm
from workers.parallel.attention_kernel import BlockAttention
from workers.parallel.context_layout import check_split, cp_positions, rank_positions, row_blocks  # noqa: F401
from workers.parallel.context_a2a import a2a_attention
from workers.parallel.context_ring import RingAttention, ring_plans

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def cp_split(x: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 0) -> torch.Tensor:
    """This CP rank's load-balanced slice of a full-sequence tensor.

    Args:
        x: full-sequence tensor.
        cp_size: number of CP ranks.
        cp_rank: this rank's index in the CP group.
        seq_dim: the sequence dimension of ``x``.

    Returns:
        Chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank`` of ``2 cp_size`` concatenated along
        ``seq_dim`` (length ``seq / cp_size``).

    Raises:
        ValueError: the sequence length is not divisible by ``2 cp_size``.
    """
    c = check_split(x.shape[seq_dim], cp_size, cp_rank)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([x.narrow(seq_dim, cp_rank * c, c), x.narrow(seq_dim, late * c, c)], dim=seq_dim)


def document_cp_split(x: torch.Tensor, cp_size: int, cp_rank: int, docs: tuple) -> torch.Tensor:
    """:func:`cp_split` of packed rows ``x [s, b]``: row ``r`` keeps this rank's share of each of its
    documents (:func:`workers.parallel.context_layout.document_split` of ``docs[r]``), in order."""
    s = x.shape[0]
    index = torch.stack([rank_positions(s, cp_size, cp_rank, cu) for cu in docs], dim=1)
    return torch.gather(x, 0, index.to(x.device))


def cp_unsplit(parts: Sequence[torch.Tensor], seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`cp_split`: the full sequence from every CP rank's slice, in CP-rank order."""
    cp = len(parts)
    if cp == 0:
        raise ValueError("cp_unsplit needs at least one part")
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for i, part in enumerate(parts):
        if part.shape[seq_dim] % 2:
            raise ValueError(f"part {i} has odd sequence length {part.shape[seq_dim]}; cp_split parts are even")
        chunks[i], chunks[2 * cp - 1 - i] = part.chunk(2, dim=seq_dim)
    return torch.cat(chunks, dim=seq_dim)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"expected q [s, b, heads, d] and k, v [s, b, kv_heads, d] of equal shape; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"num_heads {q.shape[2]} is not a multiple of num_kv_heads {k.shape[2]} "
            f"(num_attention_heads must be divisible by num_query_groups)"
        )


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None):
    """Single-process causal attention with GQA: the reference semantics of CP attention.

    Args:
        q: ``[s, b, num_heads, head_dim]``.
        k, v: ``[s, b, num_kv_heads, head_dim]``.
        softmax_scale: multiplier of ``q . k``; ``None`` means ``1 / sqrt(head_dim)``.

    Returns:
        ``[s, b, num_heads, head_dim]``.
    """
    _check_qkv(q, k, v)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"causal attention needs as many queries as keys; got {q.shape[0]} and {k.shape[0]}")
    # is_causal rather than an explicit mask: a mask tensor would be saved for backward, an
    # [s, s] block that no parallelism shards.
    sq, b, h, d = q.shape
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
        is_causal=True, scale=_scale(q, softmax_scale), enable_gqa=True,
    )
    return out.permute(2, 0, 1, 3).reshape(sq, b, h, d)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                       docs: tuple | None = None):
    """:func:`causal_attention` of whole sequences, within each packed document when ``docs``
    (every row's ``cu_seqlens``) is given: one fused-kernel call per document (rows with the same
    documents together), never an ``[s, s]`` mask."""
    if docs is None:
        return causal_attention(q, k, v, softmax_scale)
    _check_qkv(q, k, v)
    return BlockAttention.apply(q, k, v, document_plan(q.shape[0], docs), _scale(q, softmax_scale))


@functools.lru_cache(maxsize=64)
def document_plan(seq_len: int, docs: tuple) -> tuple:
    """The blocks of whole packed sequences, worked out once per microbatch (every layer reuses them)."""
    pos = torch.arange(seq_len)
    return row_blocks(docs, lambda cu: pos, lambda cu: pos)


class _GatherKV(torch.autograd.Function):
    """All-gather K/V over CP into global sequence order; backward reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, kv, group, rank_major_pos):
        ctx.group, ctx.rank_major_pos = group, rank_major_pos
        gathered = comm.all_gather(kv, group, dim=0)  # rows in CP-rank order
        return gathered.index_select(0, torch.argsort(rank_major_pos))

    @staticmethod
    def backward(ctx, grad):
        # Row i of the gathered tensor is global position rank_major_pos[i].
        grad = grad.index_select(0, ctx.rank_major_pos)
        return comm.reduce_scatter(grad, ctx.group, dim=0), None, None


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
    ranks: Sequence[int] | None,
    softmax_scale: float | None = None,
    comm_type: str = "p2p",
    hierarchy: tuple | None = None,
    docs: tuple | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole CP-split sequence.

    Inputs are this rank's :func:`cp_split` slices; the result equals this rank's rows of
    :func:`causal_attention` over the full sequence, with gradients to match.

    Args:
        q: ``[s_local, b, num_heads, head_dim]``.
        k, v: ``[s_local, b, num_kv_heads, head_dim]``.
        group: the CP process group; ``None`` (or size 1) is plain causal attention.
        ranks: the CP group's global ranks in CP-rank order (the ring's neighbours).
        softmax_scale: ``None`` means ``1 / sqrt(head_dim)``.
        comm_type: ``"p2p"`` (ring attention), ``"all_gather"``, ``"a2a"`` or ``"a2a+p2p"``.
        hierarchy: with ``"a2a+p2p"``: (a2a group, p2p group, the p2p ring's global ranks).
        docs: packed documents, each batch row's ``cu_seqlens`` over the whole sequence: no query
            attends across a document boundary (every comm type); None: one document per row.
        dtype: compute the attention in this dtype (q/k/v cast to it, the output cast back:
            float64 under ``main_grads_dtype: fp64``, where the blocks, the ring steps and the
            single process's one kernel call agree to ~1e-16 and round to the same fp32 bits);
            None: in q's dtype.

    Returns:
        ``[s_local, b, num_heads, head_dim]``.
    """
    if dtype is not None and dtype != q.dtype:
        wide = context_parallel_attention(q.to(dtype), k.to(dtype), v.to(dtype), group=group, ranks=ranks,
                                          softmax_scale=softmax_scale, comm_type=comm_type, hierarchy=hierarchy,
                                          docs=docs)
        return wide.to(q.dtype)
    _check_qkv(q, k, v)
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type {comm_type!r} is not one of {COMM_TYPES}")
    cp = comm.world_size(group)
    if cp == 1:
        return document_attention(q, k, v, softmax_scale, docs)
    ranks = tuple(int(r) for r in (ranks or ()))
    cp_rank = comm.rank(group)
    if len(ranks) != cp or ranks[cp_rank] != dist.get_rank():
        raise ValueError(
            f"ranks {list(ranks)} must list the {cp} global ranks of the CP group in CP-rank order "
            f"(this is global rank {dist.get_rank()}, CP rank {cp_rank})"
        )
    if q.shape[0] != k.shape[0] or q.shape[0] % 2:
        raise ValueError(
            f"local q/k sequence lengths {q.shape[0]}/{k.shape[0]} must be equal and even "
            f"(two cp_split chunks); split the sequence with cp_split"
        )
    seq_len = q.shape[0] * cp
    scale = _scale(q, softmax_scale)
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, scale, ring_plans(seq_len, cp, cp_rank, docs), cp_rank, ranks, group)
    positions = torch.cat([cp_positions(seq_len, cp, r, device=q.device) for r in range(cp)])
    if docs is not None:
        # Packed rows hold their own split (document_split): the gathered rows stay in rank-major
        # order and the blocks are planned on each row's positions.
        positions = torch.arange(seq_len, device=q.device)
    if comm_type in ("a2a", "a2a+p2p"):
        inner = group if comm_type == "a2a" else hierarchy[0]
        a2a = comm.world_size(inner)
        first = cp_rank - cp_rank % a2a  # this rank's a2a group: CP ranks first .. first + a2a - 1
        mine = positions[first * q.shape[0]:(first + a2a) * q.shape[0]]
    if comm_type == "a2a" or comm_type == "a2a+p2p" and a2a == cp:
        if docs is None:
            return a2a_attention(q, k, v, group=inner, positions=mine,
                                 attention=lambda q, k, v: causal_attention(q, k, v, scale))
        plan = group_plan(seq_len, cp, tuple(range(first, first + a2a)), docs)
        return a2a_attention(q, k, v, group=inner, positions=mine, ordered=False,
                             attention=lambda q, k, v: BlockAttention.apply(q, k, v, plan, scale))
    if comm_type == "a2a+p2p":
        _, outer, outer_ranks = hierarchy
        plans = hierarchical_ring_plans(seq_len, cp, a2a, cp_rank // a2a, docs)
        return a2a_attention(q, k, v, group=inner, positions=mine, ordered=False,
                             attention=lambda q, k, v: RingAttention.apply(q, k, v, scale, plans, cp_rank // a2a,
                                                                           outer_ranks, outer))
    d = k.shape[-1]
    kv = _GatherKV.apply(torch.cat([k, v], dim=-1), group, positions)
    k_full, v_full = kv.split(d, dim=-1)
    return BlockAttention.apply(q, k_full, v_full, gather_plan(seq_len, cp, cp_rank, docs), scale)


@functools.lru_cache(maxsize=64)
def hierarchical_ring_plans(seq_len: int, cp: int, a2a: int, ring_rank: int, docs: tuple | None = None) -> tuple:
    """The ring's blocks under hierarchical CP: each ring member holds the tokens of one a2a group
    (its ``a2a`` consecutive CP ranks' chunks); step ``j`` pairs ours with ring member ``ring_rank - j``'s."""
    p2p = cp // a2a

    def held(g):
        return lambda cu: torch.cat([rank_positions(seq_len, cp, g * a2a + i, cu) for i in range(a2a)])

    return tuple(row_blocks(docs, held(ring_rank), held((ring_rank - step) % p2p)) for step in range(p2p))


@functools.lru_cache(maxsize=64)
def group_plan(seq_len: int, cp: int, members: tuple, docs: tuple) -> tuple:
    """The blocks of the rows the all-to-all gathers from CP ranks ``members`` (in member order),
    against themselves: packed rows whose documents are split over the ranks."""
    def held(cu):
        return torch.cat([rank_positions(seq_len, cp, r, cu) for r in members])

    return row_blocks(docs, held, held)


@functools.lru_cache(maxsize=64)
def gather_plan(seq_len: int, cp: int, cp_rank: int, docs: tuple | None = None) -> tuple:
    """The mask-free blocks of ``cp_rank``'s queries against the whole gathered sequence.

    Each of the two query chunks sees the keys before it fully and its own chunk causally:
    four kernel calls at most, fewer where pieces merge (CP rank 0's first chunk has nothing
    before it; the last CP rank's two chunks are adjacent, so they are one causal block). Packed
    rows (``docs``) keep the gathered keys in rank-major order, each row its own split.
    """
    if docs is None:
        return row_blocks(None, lambda cu: cp_positions(seq_len, cp, cp_rank), lambda cu: torch.arange(seq_len))
    return row_blocks(docs, lambda cu: rank_positions(seq_len, cp, cp_rank, cu),
                      lambda cu: torch.cat([rank_positions(seq_len, cp, r, cu) for r in range(cp)]))
