"""Where each CP rank's tokens sit in the full sequence (Megatron's load-balanced split).

CP rank ``i`` of ``cp`` holds chunks ``i`` and ``2 cp - 1 - i`` of the sequence cut into
``2 cp`` equal chunks; with packed documents, of every document (:func:`document_split`). Pure position math, shared by the split itself
(:mod:`workers.parallel.context`), the ring's block plans (:mod:`workers.parallel.context_ring`)
and rotary embeddings (:mod:`workers.model.decoder`).
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch


def check_split(seq_len: int, cp_size: int, cp_rank: int) -> int:
    """Validate a split and return the chunk length."""
    if cp_size < 1:
        raise ValueError(f"context_parallel_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size}) for context_parallel_size {cp_size}")
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x context_parallel_size = {2 * cp_size}; "
            f"use a seq_length that is a multiple of {2 * cp_size} or a smaller context_parallel_size"
        )
    return seq_len // (2 * cp_size)


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions (``LongTensor [seq_len / cp_size]``) of the tokens :func:`cp_split` keeps.

    Used for rotary embeddings and causal masks, which must see global, not local, positions.
    """
    c = check_split(seq_len, cp_size, cp_rank)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device),
            torch.arange(late * c, (late + 1) * c, device=device),
        ]
    )


@dataclass(frozen=True)
class Block:
    """A mask-free piece of CP attention: local query rows ``q`` against key rows ``k``, for the
    batch rows ``b`` (all of them, unless packed sequences differ in their documents).

    ``causal`` blocks pair equal position ranges (the kernel's top-left ``is_causal``); the
    others are fully visible.
    """

    q: slice
    k: slice
    causal: bool
    b: slice = field(default_factory=lambda: slice(None))


def _runs(pos: list[int], cuts: set[int]) -> list[tuple[int, int, int, int]]:
    """Pieces ``(local start, local end, first position, end position)`` of consecutive
    positions, also cut at every position in ``cuts``."""
    pieces, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1 or pos[i] in cuts:
            pieces.append((start, i, pos[start], pos[i - 1] + 1))
            start = i
    return pieces


def attention_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, starts: Sequence[int] = ()) -> tuple[Block, ...]:
    """Causal visibility (query ``i`` sees key ``j`` iff ``k_pos[j] <= q_pos[i]``, and with
    ``starts`` both lie in one document) as mask-free blocks.

    Fused attention kernels take no mask on their fast paths, only ``is_causal``. Both sides
    are cut into runs of consecutive positions, each also cut where a run of the other side
    starts or ends; two pieces then either cover the same positions (a causal block) or are
    disjoint (fully visible, or skipped). Neighbouring visible pieces are merged back, so
    the load-balanced layout (:func:`cp_positions`) needs one kernel call per ring step: the
    diagonal step is one causal block over the whole local slice, a block from an earlier
    rank is every query against its first chunk, one from a later rank the second query
    chunk against both of its chunks (Megatron's three cases).

    Args:
        q_pos: global positions of the queries, ``[s_q]``.
        k_pos: global positions of the keys, ``[s_k]``.
        starts: the positions where a packed document starts (besides 0): no block crosses one,
            and a query sees no key of another document.

    Returns:
        The blocks (empty when no query sees any key); together they cover every visible
        (query, key) pair exactly once.
    """
    qp, kp, starts = q_pos.tolist(), k_pos.tolist(), sorted(set(starts))
    if not starts and qp == kp and all(a < b for a, b in zip(qp, qp[1:])):
        # Increasing positions: local causal order is global causal order.
        return (Block(slice(0, len(qp)), slice(0, len(kp)), True),)
    q_runs, k_runs = _runs(qp, set(starts)), _runs(kp, set(starts))
    q_pieces = _runs(qp, {p for r in k_runs for p in r[2:]} | set(starts))
    k_pieces = _runs(kp, {p for r in q_runs for p in r[2:]} | set(starts))
    rows: list[list[list]] = []  # per query piece: [k start, k end, causal]
    for q0, q1, qa, qb in q_pieces:
        row: list[list] = []
        for k0, k1, ka, kb in k_pieces:
            causal = (ka, kb) == (qa, qb)
            if not causal and (kb > qa or bisect_right(starts, ka) != bisect_right(starts, qa)):
                continue  # after the queries (pieces never partly overlap) or another document
            if row and not causal and not row[-1][2] and row[-1][1] == k0:
                row[-1][1] = k1  # a fully visible neighbour: one call
            else:
                row.append([k0, k1, causal])
        rows.append(row)
    blocks: list[list] = []  # [q start, q end, k start, k end, causal]
    for (q0, q1, _, _), row in zip(q_pieces, rows):
        for k0, k1, causal in row:
            prev = next((b for b in blocks if b[1] == q0 and b[2:] == [k0, k1, False]), None)
            if prev is not None and not causal:
                prev[1] = q1  # neighbouring queries against the same fully visible keys
            else:
                blocks.append([q0, q1, k0, k1, causal])
    return tuple(Block(slice(q0, q1), slice(k0, k1), causal) for q0, q1, k0, k1, causal in blocks)


def document_split(seq_len: int, cp_size: int, cu_seqlens: tuple) -> tuple[torch.Tensor, ...]:
    """Every CP rank's positions of one packed row, each document split for load balance (Megatron's
    THD split): a document is cut into ``2 cp`` chunks and CP rank ``i`` holds chunks ``i`` and
    ``2 cp - 1 - i`` of every document, its positions in increasing order.

    Documents need not be multiples of ``2 cp`` long: chunk sizes differ by at most one, the extra
    tokens going to the chunk indices in turn across the row's documents, so every chunk index holds
    ``seq_len / (2 cp)`` tokens of the row and every rank ``seq_len / cp`` (the sequence length is a
    multiple of ``2 cp``, :func:`check_split`). One document is exactly :func:`cp_positions`.
    """
    check_split(seq_len, cp_size, 0)
    n = 2 * cp_size
    chunks: list[list[int]] = [[] for _ in range(n)]
    turn = 0
    for a, b in zip(cu_seqlens, cu_seqlens[1:]):
        base, rem = divmod(b - a, n)
        start = a
        for j in range(n):
            size = base + ((j - turn) % n < rem)
            chunks[j].extend(range(start, start + size))
            start += size
        turn = (turn + rem) % n
    return tuple(torch.tensor(sorted(chunks[i] + chunks[n - 1 - i]), dtype=torch.long) for i in range(cp_size))


def rank_positions(seq_len: int, cp_size: int, cp_rank: int, cu_seqlens: tuple | None = None) -> torch.Tensor:
    """The positions CP rank ``cp_rank`` holds of a row: :func:`cp_positions`, or with packed
    documents (the row's ``cu_seqlens``) its :func:`document_split` share."""
    if cu_seqlens is None or cp_size == 1:
        return cp_positions(seq_len, cp_size, cp_rank)
    return _document_split(seq_len, cp_size, tuple(cu_seqlens))[cp_rank]


_document_split = functools.lru_cache(maxsize=256)(document_split)


def row_blocks(docs: tuple | None, q_of, k_of) -> tuple[Block, ...]:
    """:func:`attention_blocks` of every batch row of packed sequences.

    ``docs`` is each row's ``cu_seqlens`` (``(0, ..., seq_len)``, see :mod:`workers.data.packing`),
    or None: one causal sequence per row. ``q_of(cu)`` and ``k_of(cu)`` give a row's query and key
    positions (``cu`` None without documents). Rows with the same documents share their blocks.
    """
    if docs is None:
        return attention_blocks(q_of(None), k_of(None))
    if len(set(docs)) == 1:
        return attention_blocks(q_of(docs[0]), k_of(docs[0]), docs[0][1:-1])
    return tuple(replace(blk, b=slice(r, r + 1)) for r, cu in enumerate(docs)
                 for blk in attention_blocks(q_of(cu), k_of(cu), cu[1:-1]))
