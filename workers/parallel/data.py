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
buffer: a separate fp32 shard would cost 4/n bytes per parameter). One group's buffer and its
buckets are :mod:`workers.parallel.grad_buffer`; the optimizers that consume these buffers live
in :mod:`workers.parallel.optimizer`.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch

from workers.parallel.grad_buffer import MAX_SCATTERS_IN_FLIGHT, GradBuffer  # noqa: F401 (part of this module's interface)

DEFAULT_BUCKET_SIZE = 1_000_000
"""Elements per bucket: large enough to amortise latency, small enough to overlap."""

ParamGroups = Sequence[tuple[Iterable[torch.nn.Parameter], object]]


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
                # Megatron's main_grad: fold this backward's bf16/fp16 grad into fp32, drop it
                # (none: a zero-bubble B deferred the weight's GEMMs, workers.parallel.wgrad).
                if p.grad is not None:
                    view.add_(p.grad)
                p.grad = None
            elif p.grad is None or p.grad.data_ptr() != view.data_ptr():
                # Autograd replaced .grad (someone set it to None, or create_graph=True):
                # fold the new gradient into the buffer, which stays authoritative.
                if p.grad is not None:
                    view.add_(p.grad)
                p.grad = view
            self._finished = False
            # A zero-bubble B deferred part of this weight's gradient: final at its last W.
            if (self._last or id(p) in self._armed) and not getattr(p, "wgrad_deferred", 0):
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
