"""The distributed optimizer's param all-gather after each update, in place in the model's flat
param buffer (:class:`workers.parallel.optimizer.DistributedOptimizer`), at once or, with
``overlap_param_gather``, under the next forward: each bucket's all-gather stays in flight and
a forward pre-hook on every module waits for its params' bucket before the module runs."""

from __future__ import annotations

import torch

from workers.parallel import comm
from workers.parallel.grad_buffer import GradBuffer


class ParamGather:
    """Mixin of :class:`~workers.parallel.optimizer.DistributedOptimizer`: it sets
    ``overlap_param_gather`` and ``_gathering`` (``id(param) -> _Gathering``, empty)."""

    overlap_param_gather: bool
    _gathering: dict

    def _gather_params(self, buf: GradBuffer, pbuf: torch.Tensor) -> None:
        """Every bucket's all-gather, in place in ``pbuf`` from this rank's slice of it (in the
        params' dtype: bf16 halves the traffic; gloo reads the input into a staging buffer of its
        own before writing the output, so the input may alias it). Nothing to do at group size
        1: the slice is the bucket. With ``overlap_param_gather`` they stay in flight, the first
        layers' first (buckets hold the params in reverse order); :meth:`wait_params` waits."""
        if buf.num_ranks == 1:
            return
        for bucket in reversed(buf.buckets) if self.overlap_param_gather else buf.buckets:
            lo, hi, _ = buf.shard_range(bucket)
            work = comm.all_gather_into(pbuf[bucket.start : bucket.end], pbuf[lo:hi], buf.group,
                                        async_op=self.overlap_param_gather)
            if self.overlap_param_gather:
                gathering = _Gathering(bucket, work)
                self._gathering.update((id(p), gathering) for p in bucket.params)

    @torch.no_grad()
    def wait_params(self, params) -> None:
        """Finish the all-gathers that update ``params`` (a forward pre-hook calls it per module)."""
        if not self._gathering:
            return
        for p in params:
            gathering = self._gathering.get(id(p))
            if gathering is not None:
                self._finish(gathering)

    def finish_param_gather(self) -> None:
        """Finish every all-gather in flight: before anything reads or writes the params outside a
        forward (a checkpoint, the next update, a state load)."""
        while self._gathering:
            self._finish(next(iter(self._gathering.values())))

    def _finish(self, g: "_Gathering") -> None:
        comm.wait(g.work)  # the params are views of the buffer it gathers into: nothing to copy
        for p in g.bucket.params:
            del self._gathering[id(p)]

    def hook_param_gather(self, modules) -> list:
        """With ``overlap_param_gather``: a forward pre-hook on every module of ``modules`` (and
        their submodules) that holds params, waiting for its params' all-gather; returns the
        handles (empty without overlap)."""
        if not self.overlap_param_gather:
            return []
        return [m.register_forward_pre_hook(lambda mod, args: self.wait_params(mod.parameters(recurse=False)))
                for root in modules for m in root.modules() if next(m.parameters(recurse=False), None) is not None]


class _Gathering:
    """One bucket's in-place param all-gather in flight (:meth:`DistributedOptimizer.wait_params`)."""

    __slots__ = ("bucket", "work")

    def __init__(self, bucket, work):
        self.bucket, self.work = bucket, work
