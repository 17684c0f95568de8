"""Initial weights as a pure function of (seed, name, full shape), drawn per shard.

A parameter's full, unsharded tensor is cut into fixed blocks, and each block is drawn from
its own counter-based generator (Philox, keyed by the job seed and the parameter's name, the
block's index as the counter): no generator state runs from one block to the next, so a rank
draws only the blocks its shard overlaps, in O(shard) time and memory, and gets the same
numbers a single process gets for those positions. That is what keeps layouts
interchangeable (the full model is the same) without every rank drawing the whole model.

Blocks follow the last dimension, so both kinds of tensor-parallel split stay O(shard): a row
of up to :data:`BLOCK` elements belongs to one block with its neighbours (whole rows per
block: a dim-0 split reads whole blocks), and a longer row is cut into tiles of :data:`BLOCK`
(a last-dim split reads only its tiles of each row).

The parts of the model that are not one normal tensor are built from lazy pieces with the
same interface (``shape``, ``narrow``, ``materialize``): :class:`Cat` (fused QKV per query
group, gate/up interleaved per TP rank) and :class:`Zeros` (vocab padding). A layer slices a
lazy full weight with ``narrow`` exactly as it would a tensor, and only the slice is made.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

BLOCK = 4096
"""Elements per generator block: large enough that seeding is cheap next to drawing."""


def _key(seed: int, name: str) -> int:
    """Philox's 128-bit key for one parameter."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=16).digest(), "little")


def _block(key: int, index: int, n: int) -> np.ndarray:
    """Block ``index``'s ``n`` standard normal float64 values.

    The block index is the counter's second 64-bit word: drawing advances the first word,
    so blocks' streams never overlap.
    """
    return np.random.Generator(np.random.Philox(counter=index << 64, key=key)).standard_normal(n)


def _rows(box: Sequence[tuple[int, int]], lead: Sequence[int]) -> np.ndarray:
    """Indices, ascending, of the box's rows in the full tensor viewed as ``[rows, last]``."""
    index, stride = np.zeros((), dtype=np.int64), 1
    for dim in reversed(range(len(lead))):
        offset, length = box[dim]
        step = np.arange(offset, offset + length, dtype=np.int64) * stride
        index = index + step.reshape((length,) + (1,) * (len(lead) - 1 - dim))
        stride *= lead[dim]
    return index.reshape(-1)


def draw(key: int, full_shape: Sequence[int], box: Sequence[tuple[int, int]]) -> np.ndarray:
    """Standard normal values of ``box`` (``(offset, length)`` per dim) of a full tensor."""
    lead, last = tuple(full_shape[:-1]), full_shape[-1]
    rows = _rows(box[:-1], lead)
    c0, width = box[-1]
    out = np.empty((rows.size, width))
    if last <= BLOCK:
        per = BLOCK // last  # whole rows per block
        total = int(np.prod(lead, dtype=np.int64)) if lead else 1
        blocks, starts, counts = np.unique(rows // per, return_index=True, return_counts=True)
        for b, start, count in zip(blocks.tolist(), starts.tolist(), counts.tolist()):
            first = b * per
            values = _block(key, b, min(per, total - first) * last).reshape(-1, last)
            out[start : start + count] = values[rows[start : start + count] - first, c0 : c0 + width]
    else:
        tiles = -(-last // BLOCK)
        t0, t1 = c0 // BLOCK, (c0 + width - 1) // BLOCK
        for i, r in enumerate(rows.tolist()):
            parts = [_block(key, r * tiles + t, min(BLOCK, last - t * BLOCK)) for t in range(t0, t1 + 1)]
            out[i] = np.concatenate(parts)[c0 - t0 * BLOCK : c0 - t0 * BLOCK + width]
    return out.reshape(tuple(length for _, length in box))


class NormalInit:
    """``N(0, std^2)`` over a full tensor of ``shape``, or a box of it (``narrow``), made lazily.

    Args:
        seed: the job seed.
        name: the parameter's full name (keys the generator).
        shape: the full tensor's shape (fixes each element's counter).
        std: standard deviation.
    """

    def __init__(self, seed: int, name: str, shape: Sequence[int], std: float,
                 box: tuple[tuple[int, int], ...] | None = None):
        self.seed, self.name, self.full_shape, self.std = seed, name, tuple(shape), std
        self.key = _key(seed, name)
        self.box = box if box is not None else tuple((0, n) for n in self.full_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(length for _, length in self.box)

    def narrow(self, dim: int, start: int, length: int) -> "NormalInit":
        offset, size = self.box[dim]
        if not (0 <= start and start + length <= size):
            raise ValueError(f"{self.name}: narrow({dim}, {start}, {length}) is outside size {size}")
        box = self.box[:dim] + ((offset + start, length),) + self.box[dim + 1:]
        return NormalInit(self.seed, self.name, self.full_shape, self.std, box)

    def materialize(self, device=None) -> torch.Tensor:
        """The float32 values of the box: O(box) work, whatever the full size."""
        values = draw(self.key, self.full_shape, self.box) * self.std
        return torch.from_numpy(values.astype(np.float32)).to(device)


class Zeros:
    """A lazy all-zero block (e.g. the rows that pad the vocabulary to a multiple of tp)."""

    def __init__(self, shape: Sequence[int]):
        self.shape = tuple(shape)

    def narrow(self, dim: int, start: int, length: int) -> "Zeros":
        return Zeros(self.shape[:dim] + (length,) + self.shape[dim + 1:])

    def materialize(self, device=None) -> torch.Tensor:
        return torch.zeros(self.shape, device=device)


class Cat:
    """Lazy ``torch.cat(parts, dim)``; narrowing it narrows only the parts it overlaps."""

    def __init__(self, parts: Sequence, dim: int = 0):
        if not parts:
            raise ValueError("Cat needs at least one part")
        self.parts, self.dim = list(parts), dim
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape = tuple(shape)

    def narrow(self, dim: int, start: int, length: int) -> "Cat":
        if dim != self.dim:
            return Cat([p.narrow(dim, start, length) for p in self.parts], self.dim)
        kept, offset = [], 0
        for p in self.parts:
            size = p.shape[dim]
            lo, hi = max(start, offset), min(start + length, offset + size)
            if lo < hi:
                kept.append(p.narrow(dim, lo - offset, hi - lo))
            offset += size
        return Cat(kept, dim)

    def materialize(self, device=None) -> torch.Tensor:
        return torch.cat([materialize(p, device) for p in self.parts], dim=self.dim)


def materialize(x, device=None) -> torch.Tensor:
    """A tensor from a tensor or a lazy block (:class:`NormalInit`, :class:`Cat`, :class:`Zeros`)."""
    return x if isinstance(x, torch.Tensor) else x.materialize(device)
