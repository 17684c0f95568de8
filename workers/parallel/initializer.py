"""Initial weights as a pure function of (seed, name, full shape), drawn per shard.

Every element of a parameter's full, unsharded tensor is a normal variate computed from its
own counter, the element's flat index in the full tensor, keyed by the job seed and the
parameter's name (a counter-based generator, as Philox is): no generator state runs through
the tensor, so a rank computes exactly its shard's elements, in O(shard) time and memory,
and gets the same numbers a single process gets for those positions. That is what keeps
layouts interchangeable (the full model is the same) without every rank drawing the whole
model first.

The parts of the model that are not one normal tensor are built from lazy pieces with the
same interface (``shape``, ``narrow``, ``materialize``): :class:`Cat` (fused QKV per query
group, gate/up interleaved per TP rank) and :class:`Zeros` (vocab padding). A layer slices a
lazy full weight with ``narrow`` exactly as it would a tensor, and only the slice is made.

The generator: the counter's low 32 bits, keyed, go through MurmurHash3's 32-bit finaliser
(one more round folds in the high bits of counters past 2**32); two more keyed rounds give two
32-bit uniforms, then Box-Muller in float64. The 32-bit multiplies are done in 16-bit halves
so no int64 product overflows.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

_M32 = 0xFFFFFFFF


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` in place, for int64 ``x`` in [0, 2**32), without int64 overflow."""
    hi = x >> 16
    x &= 0xFFFF
    x *= c
    hi *= c
    hi &= 0xFFFF
    hi <<= 16
    x += hi
    x &= _M32
    return x


def _fmix32_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser in place: a bijection of [0, 2**32) with full avalanche."""
    x ^= x >> 16
    x = _mul32_(x, 0x85EBCA6B)
    x ^= x >> 13
    x = _mul32_(x, 0xC2B2AE35)
    x ^= x >> 16
    return x


def normal_from_counters(counters: torch.Tensor, key: int) -> torch.Tensor:
    """Standard normal float64 variates, one per int64 ``counter`` (>= 0), keyed by ``key``."""
    k0, k1 = key & _M32, (key >> 32) & _M32
    base = _fmix32_((counters & _M32) ^ k0)
    if counters.numel() and int(counters.max()) >> 32:  # tensors past 2**32 elements
        hi = counters >> 32
        base = torch.where(hi != 0, _fmix32_(base ^ hi), base)
    u1 = (_fmix32_(base ^ (0x9E3779B9 ^ k1)).double() + 0.5) / 2.0**32  # in (0, 1): log is finite
    u2 = _fmix32_(base ^ (0x7F4A7C15 ^ k1)).double() / 2.0**32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


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
        from workers.config import stable_seed

        self.seed, self.name, self.full_shape, self.std = seed, name, tuple(shape), std
        self.key = stable_seed(seed, name)
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
        counters = torch.zeros((), dtype=torch.int64, device=device)
        stride = 1
        for dim in reversed(range(len(self.full_shape))):
            offset, length = self.box[dim]
            index = torch.arange(offset, offset + length, dtype=torch.int64, device=device) * stride
            counters = counters + index.view((length,) + (1,) * (len(self.full_shape) - 1 - dim))
            stride *= self.full_shape[dim]
        return (normal_from_counters(counters, self.key) * self.std).to(torch.float32)


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
