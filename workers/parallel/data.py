"""Data parallelism: bucketed, overlapped gradient reduction and a ZeRO-1 optimizer.

The trainer scales each microbatch's loss so that gradients *summed* over a data-parallel
group equal the single-process gradient of the global-batch mean loss; reduction here is
therefore a plain SUM. Each ``(params, group)`` "param group" (dense params over dp-cp,
expert params over expert-dp, ``group=None`` for size 1) gets one contiguous flat gradient
buffer, and every param's ``.grad`` is a view into it, so microbatches accumulate in place.

Reduction happens once per iteration. During the backward of the microbatch the caller
marks as the last one, a post-accumulate-grad hook counts each bucket's params; a bucket
whose grads are all final is reduced asynchronously while backward goes on (Megatron's
overlap). Buckets are launched strictly in index order so every rank issues the same
collectives in the same order, whatever order autograd visits params in. ``finish()``
launches what is left and waits, so results are identical with or without overlap (and a
caller that never marks the last microbatch is merely slower).

With interleaving a stage holds several model chunks whose last backwards come at different
times; :meth:`DataParallelGrads.arm` marks one chunk's params final on its own (Megatron enables
each chunk's grad sync on that chunk's last microbatch), so every bucket can go out during
backward with or without interleaving.

Mixed precision (Megatron's ``main_grad``): with ``grad_dtype=torch.float32`` and bf16/fp16
params, the flat buffer is fp32 and is *not* the params' ``.grad`` (autograd insists that a
grad has its param's dtype). Each backward leaves a low-precision ``.grad``; the hook adds it
into the fp32 buffer and drops it, so microbatches accumulate and reduce in fp32.

Every managed param's ``main_grad`` is its buffer view: in fp32 the parallel linears
accumulate their weight gradients straight into it and hand autograd a dummy
(:mod:`workers.parallel.wgrad`); the hook drops the dummy and still marks the bucket.

With ``shard=True`` (the distributed optimizer) each bucket is padded to a multiple of the
group size and reduce-scattered in place: rank r's slice of every bucket (the r-th 1/n) ends up
holding the summed gradient there, in the flat buffer itself (Megatron's layout, no second
buffer: a separate fp32 shard would cost 4/n bytes per parameter). The optimizers that consume these buffers live in
:mod:`workers.parallel.optimizer`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Sequence

import torch

from workers.parallel import comm

DEFAULT_BUCKET_SIZE = 1_000_000
"""Elements per bucket: large enough to amortise latency, small enough to overlap."""

MAX_SCATTERS_IN_FLIGHT = 2
"""Reduce-scatters (``shard=True``) launched and not yet waited for, at most. Gloo stages each
one's input in a copy of its own that lives until the work is waited for: with every bucket in
flight at the end of backward, that is a second full gradient buffer (measured: the distributed
optimizer's training peak was above the replicated one's). Waiting for the oldest before
launching past this bound keeps the staging to two buckets; gloo runs its collectives one after
the other anyway, so the backward still overlaps the one in progress."""

ParamGroups = Sequence[tuple[Iterable[torch.nn.Parameter], object]]


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

    def shard_view(self, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of this rank's shard (the concatenation of its slices of the
        buckets, :meth:`pieces`' coordinates), a view into the flat buffer; the range must lie
        in one bucket's slice."""
        for bucket, view in zip(self.buckets, self.shard_views):
            base = bucket.start // self.num_ranks
            if base <= a and b <= base + view.numel():
                return view[a - base : b - base]
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


class DataParallelGrads:
    """Flat, bucketed gradient buffers for several param groups, reduced once per iteration.

    Usage per iteration: ``zero()``; backward each microbatch, wrapping the last one in
    ``with grads.last_microbatch():`` to overlap reduction with it; ``finish()``. Afterwards
    ``p.grad`` holds the sum over the group (or, with ``shard=True``, each buffer's
    this rank's slice of each bucket holds the sum and the rest of ``p.grad`` the local sums).

    Args:
        param_groups: ``[(params, group), ...]``; a param may appear in one group only.
        bucket_size: elements per bucket (``None``: one bucket per group).
        shard: reduce-scatter instead of all-reduce (used by :class:`DistributedOptimizer`).
        grad_dtype: accumulate and reduce in this dtype (fp32 main grads for bf16/fp16 params).
    """

    def __init__(self, param_groups: ParamGroups, *, bucket_size: int | None = DEFAULT_BUCKET_SIZE, shard: bool = False,
                 grad_dtype: torch.dtype | None = None):
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of elements or None, got {bucket_size}")
        seen: set[int] = set()
        self.buffers: list[GradBuffer] = []
        for params, group in param_groups:
            params = list(params)
            if seen & {id(p) for p in params} or len({id(p) for p in params}) != len(params):
                raise ValueError("a param appears twice in param_groups; list each param in exactly one group")
            seen |= {id(p) for p in params}
            self.buffers.append(GradBuffer(params, group, bucket_size, shard=shard, grad_dtype=grad_dtype))
        self._last = False
        self._armed: set[int] = set()  # ids of params whose gradients are final this iteration
        self._finished = False
        self._hooks = []
        for buf in self.buffers:
            for p in buf.params:
                p.main_grad = buf.view(p)  # Megatron's name; see workers.parallel.wgrad
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(buf)))

    def _make_hook(self, buf: GradBuffer):
        def hook(p: torch.Tensor) -> None:
            view = buf.view(p)
            if getattr(p, "grad_added_to_main_grad", False):
                # The weight-gradient GEMM accumulated into the buffer; .grad is its dummy
                # (with zero_out_wgrad: zeros plus the weight's other uses' gradient).
                p.grad_added_to_main_grad = False
                if getattr(p, "zero_out_wgrad", False):
                    view.add_(p.grad)
                p.grad = None if buf.main_grads else view
            elif buf.main_grads:
                # Megatron's main_grad: fold this backward's bf16/fp16 grad into fp32, drop it.
                view.add_(p.grad)
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != view.data_ptr():
                # Autograd replaced .grad (someone set it to None, or create_graph=True):
                # fold the new gradient into the buffer, which stays authoritative.
                if p.grad is not None:
                    view.add_(p.grad)
                p.grad = view
            self._finished = False
            if self._last or id(p) in self._armed:
                buf.mark_ready(p)

        return hook

    def set_last_microbatch(self, last: bool) -> None:
        """Mark whether the next backward is the iteration's last (reduce as buckets fill)."""
        self._last = last

    def arm(self, params: Iterable[torch.Tensor]) -> None:
        """Mark ``params``' next backward as their last this iteration (reduce as buckets fill).

        Unlike :meth:`set_last_microbatch` this covers only ``params``: with interleaving, one
        model chunk's last backward comes while other chunks still have backwards to run.
        Cleared by :meth:`finish`.
        """
        self._armed.update(id(p) for p in params)

    @contextlib.contextmanager
    def last_microbatch(self):
        """Context for the last microbatch's backward; see :meth:`set_last_microbatch`."""
        self._last = True
        try:
            yield self
        finally:
            self._last = False

    def num_launched(self) -> int:
        """Buckets whose reduction has been launched in the current iteration."""
        return sum(b.launched for buf in self.buffers for b in buf.buckets)

    def num_buckets(self) -> int:
        return sum(len(buf.buckets) for buf in self.buffers)

    def finish(self) -> None:
        """Launch every bucket not yet launched, wait for all; a no-op if already finished."""
        self._last = False
        self._armed.clear()
        if self._finished:
            return
        for buf in self.buffers:
            buf.launch_remaining()
        for buf in self.buffers:
            buf.wait()
        self._finished = True

    def zero(self) -> None:
        """Zero all gradients (before an iteration's first microbatch)."""
        assert self.num_launched() == 0, "zero() while reductions are in flight; call finish() first"
        for buf in self.buffers:
            buf.grad.zero_()
            for p in buf.params:
                p.grad = None if buf.main_grads else buf.view(p)
        self._finished = False

    def remove_hooks(self) -> None:
        """Detach from the params: their hooks, and ``main_grad`` (without the hook, a fused
        backward's dummy would stay in ``.grad``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for p in (p for buf in self.buffers for p in buf.params):
            vars(p).pop("main_grad", None)
