"""Where each CP rank's tokens sit in the full sequence (Megatron's load-balanced split).

CP rank ``i`` of ``cp`` holds chunks ``i`` and ``2 cp - 1 - i`` of the sequence cut into
``2 cp`` equal chunks. Pure position math, shared by the split itself
(:mod:`workers.parallel.context`), the ring's block plans (:mod:`workers.parallel.context_ring`)
and rotary embeddings (:mod:`workers.model`).
"""

from __future__ import annotations

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
