"""One flat gradient buffer of a data-parallel param group and its buckets (see
:mod:`workers.parallel.data`, whose :class:`~workers.parallel.data.DataParallelGrads` owns one
per group): where each param's gradient lives in it, which rank owns which slice of each bucket
under the distributed optimizer, and the launch of each bucket's all-reduce or in-place
reduce-scatter, in bucket order."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from workers.parallel import comm

MAX_SCATTERS_IN_FLIGHT = 2
"""Reduce-scatters (``shard=True``) launched and not yet waited for, at most. Gloo stages each
one's input in a copy of its own that lives until the work is waited for: with every bucket in
flight at the end of backward, that is a second full gradient buffer (measured: the distributed
optimizer's training peak was above the replicated one's). Waiting for the oldest before
launching past this bound keeps the staging to two buckets; gloo runs its collectives one after
the other anyway, so the backward still overlaps the one in progress."""


class _Bucket:
    """A contiguous ``[start, end)`` range of a flat buffer holding whole params."""

    def __init__(self, index: int, start: int, end: int, params: list):
        self.index, self.start, self.end, self.params = index, start, end, params
        self.ready: set[int] = set()
        self.work = None
        self.launched = False


class GradBuffer:
    """One param group's flat gradient buffer, split into buckets.

    Args:
        params: the params (registration order); those without ``requires_grad`` are skipped.
        group: the process group gradients are summed over (``None``: size 1).
        bucket_size: elements per bucket (a bucket closes once it reaches this size; a param
            is never split); ``None`` puts everything in one bucket.
        shard: pad buckets to a multiple of the group size and reduce-scatter them into
            in place (this rank's slice of each bucket, :attr:`shard_views`) instead of
            all-reducing them.
        grad_dtype: the buffer's dtype (accumulation and reduction); default the params'.
            When it differs, the buffer holds main grads (see the module docstring).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group, bucket_size: int | None, *, shard: bool,
                 grad_dtype: torch.dtype | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.shard = group, shard
        self.num_ranks, self.rank = comm.world_size(group), comm.rank(group)
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("a param group mixes dtypes/devices; split it into one group per dtype and device")
        align = self.num_ranks if shard else 1
        limit = bucket_size if bucket_size is not None else math.inf
        self.offsets: dict[int, int] = {}  # id(param) -> start in the flat buffer
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        start = end = 0
        members: list = []
        # Reverse registration order: backward produces the last layers' grads first.
        for i, p in enumerate(reversed(self.params)):
            self.offsets[id(p)] = end
            end += p.numel()
            members.append(p)
            if end - start >= limit or i == len(self.params) - 1:
                end = start + -(-(end - start) // align) * align
                bucket = _Bucket(len(self.buckets), start, end, members)
                self.buckets.append(bucket)
                self._bucket_of.update((id(q), bucket) for q in members)
                start, members = end, []
        self.numel = end
        like = self.params[0] if self.params else torch.empty(0)
        dtype = grad_dtype or like.dtype
        self.main_grads = dtype != like.dtype  # True: .grad is low precision, folded in by the hook
        self.grad = torch.zeros(self.numel, dtype=dtype, device=like.device)
        # This rank's slice of each bucket, in bucket order: the shard, in place.
        self.shard_views = [self.grad[lo:hi] for lo, hi, _ in map(self.shard_range, self.buckets)] if shard else []
        self._next = 0
        for p in self.params:
            p.grad = None if self.main_grads else self.view(p)

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient as a view into the flat buffer."""
        start = self.offsets[id(p)]
        return self.grad[start : start + p.numel()].view_as(p)

    def shard_range(self, bucket: _Bucket) -> tuple[int, int, int]:
        """This rank's slice of ``bucket``: (flat start, flat end, start in the shard)."""
        size = (bucket.end - bucket.start) // self.num_ranks
        return bucket.start + self.rank * size, bucket.start + (self.rank + 1) * size, bucket.start // self.num_ranks

    def shard_view(self, a: int, b: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[a, b)`` of this rank's shard (the concatenation of its slices of the
        buckets, :meth:`pieces`' coordinates), a view into the flat gradient buffer, or into
        ``flat``, a buffer laid out as it (the distributed optimizer's param buffer); the range
        must lie in one bucket's slice."""
        flat = self.grad if flat is None else flat
        for bucket in self.buckets:
            lo, hi, base = self.shard_range(bucket)
            if base <= a and b <= base + hi - lo:
                return flat[lo + a - base : lo + b - base]
        raise ValueError(f"shard range [{a}, {b}) crosses a bucket boundary")

    def shard_bounds(self) -> list[int]:
        """Where each bucket's slice starts in this rank's shard, and its end."""
        return [b.start // self.num_ranks for b in self.buckets] + [self.numel // self.num_ranks]

    def pieces(self):
        """Yield ``(param, begin, end, shard_start)``: elements [begin, end) of the flat
        ``param`` that this rank's shard holds, at ``shard_start`` in the shard."""
        for bucket in self.buckets:
            lo, hi, base = self.shard_range(bucket)
            for p in bucket.params:
                a = self.offsets[id(p)]
                b = a + p.numel()
                if max(a, lo) < min(b, hi):
                    yield p, max(a, lo) - a, min(b, hi) - a, base + max(a, lo) - lo

    def mark_ready(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of[id(p)]
        if bucket.launched:
            raise RuntimeError(
                f"a param of shape {tuple(p.shape)} got a gradient after its bucket {bucket.index} was already "
                "reduced in this iteration; run one backward per microbatch, or do not mark the last microbatch"
            )
        bucket.ready.add(id(p))
        # In index order only: every rank must issue the same collectives in the same order.
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])

    def launch_remaining(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        flat = self.grad[bucket.start : bucket.end]
        if self.shard:
            in_flight = [b for b in self.buckets[: bucket.index] if b.work is not None]
            for old in in_flight[: max(0, len(in_flight) - MAX_SCATTERS_IN_FLIGHT + 1)]:
                old.work.wait()
                old.work = None  # releases gloo's staging copy
            lo, hi, _ = self.shard_range(bucket)
            out = self.grad[lo:hi]  # in place: this rank's slice of the bucket
            bucket.work = comm.reduce_scatter_into(out, flat, self.group, async_op=True)
        else:
            bucket.work = comm.all_reduce(flat, self.group, async_op=True)
        bucket.launched = True
        self._next += 1

    def wait(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.launched = None, False
            bucket.ready.clear()
        self._next = 0
