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

With ``shard=True`` (the distributed optimizer) each bucket is padded to a multiple of the
group size and reduce-scattered: rank r keeps the summed gradient of the r-th 1/n slice of
every bucket, Megatron's layout. :class:`DistributedOptimizer` runs AdamW on an fp32 master
copy of those slices and all-gathers the result back into the params.
:class:`ReplicatedOptimizer` is the plain path (all-reduce + ``torch.optim.AdamW``); both
share one interface, built by :func:`build_optimizer`. This file is longer than the usual
~300 lines because the grad buffers, both optimizers and their checkpoint state share one
layout and are easiest to check together.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Sequence

import torch

from workers.parallel import comm

DEFAULT_BUCKET_SIZE = 1_000_000
"""Elements per bucket: large enough to amortise latency, small enough to overlap."""

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
            :attr:`shard_grad` instead of all-reducing them in place.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group, bucket_size: int | None, *, shard: bool):
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
        self.grad = torch.zeros(self.numel, dtype=like.dtype, device=like.device)
        self.shard_grad = torch.zeros(self.numel // self.num_ranks, dtype=like.dtype, device=like.device) if shard else None
        self._next = 0
        for p in self.params:
            p.grad = self.view(p)

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient as a view into the flat buffer."""
        start = self.offsets[id(p)]
        return self.grad[start : start + p.numel()].view_as(p)

    def shard_range(self, bucket: _Bucket) -> tuple[int, int, int]:
        """This rank's slice of ``bucket``: (flat start, flat end, start in the shard)."""
        size = (bucket.end - bucket.start) // self.num_ranks
        return bucket.start + self.rank * size, bucket.start + (self.rank + 1) * size, bucket.start // self.num_ranks

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
            lo, hi, base = self.shard_range(bucket)
            out = self.shard_grad[base : base + hi - lo]
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
    ``shard_grad`` holds this rank's slice of it and ``p.grad`` the local sum).

    Args:
        param_groups: ``[(params, group), ...]``; a param may appear in one group only.
        bucket_size: elements per bucket (``None``: one bucket per group).
        shard: reduce-scatter instead of all-reduce (used by :class:`DistributedOptimizer`).
    """

    def __init__(self, param_groups: ParamGroups, *, bucket_size: int | None = DEFAULT_BUCKET_SIZE, shard: bool = False):
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of elements or None, got {bucket_size}")
        seen: set[int] = set()
        self.buffers: list[GradBuffer] = []
        for params, group in param_groups:
            params = list(params)
            if seen & {id(p) for p in params} or len({id(p) for p in params}) != len(params):
                raise ValueError("a param appears twice in param_groups; list each param in exactly one group")
            seen |= {id(p) for p in params}
            self.buffers.append(GradBuffer(params, group, bucket_size, shard=shard))
        self._last = False
        self._finished = False
        self._hooks = []
        for buf in self.buffers:
            for p in buf.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(buf)))

    def _make_hook(self, buf: GradBuffer):
        def hook(p: torch.Tensor) -> None:
            view = buf.view(p)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                # Autograd replaced .grad (someone set it to None, or create_graph=True):
                # fold the new gradient into the buffer, which stays authoritative.
                if p.grad is not None:
                    view.add_(p.grad)
                p.grad = view
            self._finished = False
            if self._last:
                buf.mark_ready(p)

        return hook

    def set_last_microbatch(self, last: bool) -> None:
        """Mark whether the next backward is the iteration's last (reduce as buckets fill)."""
        self._last = last

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
                p.grad = buf.view(p)
        self._finished = False

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas {tuple(betas)} must each lie in [0, 1), e.g. (0.9, 0.999)")


@torch.no_grad()
def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step in place: exactly ``torch.optim.AdamW``'s single-tensor math (decoupled
    weight decay, bias correction). Written out rather than calling torch.optim, whose first
    use imports torch._dynamo (~2 CPU-seconds per rank at start-up)."""
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class _AdamWOverGrads:
    """What both optimizers share: AdamW's hyperparameters, the bucketed grads, the step count."""

    def __init__(self, param_groups: ParamGroups, lr: float, betas, eps: float, weight_decay: float, *,
                 bucket_size: int | None, shard: bool):
        _check_hparams(lr, betas, eps, weight_decay)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.grads = DataParallelGrads(param_groups, bucket_size=bucket_size, shard=shard)
        self.num_steps = 0

    def zero_grad(self) -> None:
        self.grads.zero()

    def _update(self, param, grad, exp_avg, exp_avg_sq) -> None:
        adamw_update(param, grad, exp_avg, exp_avg_sq, step=self.num_steps, lr=self.lr, betas=self.betas,
                     eps=self.eps, weight_decay=self.weight_decay)


class DistributedOptimizer(_AdamWOverGrads):
    """ZeRO-1 AdamW: each rank keeps the fp32 master params and Adam moments of its 1/n shard.

    The math is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction), applied
    elementwise to the flat shard, so per-rank optimizer memory is ~1/n of the model's.

    Args:
        param_groups: ``[(params, group), ...]`` as for :class:`DataParallelGrads`.
        lr, betas, eps, weight_decay: AdamW's hyperparameters (``lr`` may be reassigned).
        bucket_size: elements per gradient bucket.
    """

    def __init__(self, param_groups: ParamGroups, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, bucket_size: int | None = DEFAULT_BUCKET_SIZE):
        super().__init__(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size, shard=True)
        self.shards = []
        for buf in self.grads.buffers:
            n = buf.numel // buf.num_ranks
            master = torch.zeros(n, dtype=torch.float32, device=buf.grad.device)
            self.shards.append({"param": master, "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)})
            self._load_master(buf, master)

    @staticmethod
    @torch.no_grad()
    def _load_master(buf: GradBuffer, master: torch.Tensor) -> None:
        for p, a, b, s in buf.pieces():
            master[s : s + b - a].copy_(p.detach().reshape(-1)[a:b])

    @torch.no_grad()
    def step(self) -> None:
        """Finish the gradient reduction, update this rank's shard, all-gather the params."""
        self.grads.finish()
        self.num_steps += 1
        for buf, state in zip(self.grads.buffers, self.shards):
            master, exp_avg, exp_avg_sq = state["param"], state["exp_avg"], state["exp_avg_sq"]
            if buf.params and buf.params[0].dtype == torch.float32:
                # fp32 params hold exactly the master values; re-reading them keeps the master
                # right if model weights were loaded after this optimizer was built.
                self._load_master(buf, master)
            self._update(master, buf.shard_grad.float(), exp_avg, exp_avg_sq)
            self._gather_params(buf, master)

    def _gather_params(self, buf: GradBuffer, master: torch.Tensor) -> None:
        scratch = torch.empty(max((b.end - b.start for b in buf.buckets), default=0), dtype=buf.grad.dtype,
                              device=buf.grad.device)
        for bucket in buf.buckets:
            lo, hi, base = buf.shard_range(bucket)
            full = scratch[: bucket.end - bucket.start]
            comm.all_gather_into(full, master[base : base + hi - lo].to(buf.grad.dtype), buf.group)
            for p in bucket.params:
                a = buf.offsets[id(p)] - bucket.start
                p.detach().copy_(full[a : a + p.numel()].view_as(p))

    def state_dict(self) -> dict:
        """This rank's sharded state (valid only for the same layout: group sizes, buckets)."""
        return {"step": self.num_steps, "numel": [buf.numel for buf in self.grads.buffers],
                "num_ranks": [buf.num_ranks for buf in self.grads.buffers],
                "shards": [{k: v.clone() for k, v in s.items()} for s in self.shards]}

    def load_state_dict(self, state: dict) -> None:
        mine = ([buf.numel for buf in self.grads.buffers], [buf.num_ranks for buf in self.grads.buffers])
        if (list(state["numel"]), list(state["num_ranks"])) != mine:
            raise ValueError(
                f"sharded optimizer state for buffers of {state['numel']} elements over {state['num_ranks']} ranks "
                f"does not fit this layout ({mine[0]} over {mine[1]}); load a full_state_dict() instead"
            )
        self.num_steps = int(state["step"])
        for dst, src in zip(self.shards, state["shards"]):
            for k in dst:
                dst[k].copy_(src[k])

    def full_state_dict(self) -> dict:
        """The unsharded AdamW moments, layout-independent (a collective over every group).

        Returns ``{"step": int, "state": [[{"exp_avg", "exp_avg_sq"} per param] per group]}``
        with params in the order given and tensors of the params' shapes.
        """
        out = []
        for buf, shard in zip(self.grads.buffers, self.shards):
            full = {}
            for key in ("exp_avg", "exp_avg_sq"):
                flat = torch.empty(buf.numel, dtype=torch.float32, device=buf.grad.device)
                for bucket in buf.buckets:
                    lo, hi, base = buf.shard_range(bucket)
                    comm.all_gather_into(flat[bucket.start : bucket.end], shard[key][base : base + hi - lo], buf.group)
                full[key] = flat
            out.append([{k: full[k][buf.offsets[id(p)] : buf.offsets[id(p)] + p.numel()].view(p.shape).clone()
                         for k in full} for p in buf.params])
        return {"step": self.num_steps, "state": out}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load :meth:`full_state_dict` output (from any layout); the model params must hold
        the matching weights already (they are the master copy)."""
        _check_full_state(state, self.grads.buffers)
        self.num_steps = int(state["step"])
        for buf, shard, entries in zip(self.grads.buffers, self.shards, state["state"]):
            index = {id(p): i for i, p in enumerate(buf.params)}
            self._load_master(buf, shard["param"])
            for p, a, b, s in buf.pieces():
                for key in ("exp_avg", "exp_avg_sq"):
                    shard[key][s : s + b - a].copy_(entries[index[id(p)]][key].reshape(-1)[a:b])


def _check_full_state(state: dict, buffers: list[GradBuffer]) -> None:
    want = [[tuple(p.shape) for p in buf.params] for buf in buffers]
    got = [[tuple(e["exp_avg"].shape) for e in group] for group in state["state"]]
    if want != got:
        raise ValueError(f"optimizer state holds params of shapes {got}, this model has {want}")


class ReplicatedOptimizer(_AdamWOverGrads):
    """The plain data-parallel path: all-reduced buckets + AdamW on the full params.

    Same interface as :class:`DistributedOptimizer` (and the same math, :func:`adamw_update`);
    every rank holds the full state.
    """

    def __init__(self, param_groups: ParamGroups, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, bucket_size: int | None = DEFAULT_BUCKET_SIZE):
        super().__init__(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size, shard=False)
        self.moments = [[self._zeros(p) for p in buf.params] for buf in self.grads.buffers]

    @staticmethod
    def _zeros(p: torch.Tensor) -> dict:
        return {"exp_avg": torch.zeros_like(p, dtype=torch.float32), "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}

    @torch.no_grad()
    def step(self) -> None:
        self.grads.finish()
        self.num_steps += 1
        for buf, moments in zip(self.grads.buffers, self.moments):
            for p, m in zip(buf.params, moments):
                self._update(p, p.grad, m["exp_avg"], m["exp_avg_sq"])

    def state_dict(self) -> dict:
        # A copy: the live moment tensors change at the next step.
        return self.full_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_full_state_dict(state)

    def full_state_dict(self) -> dict:
        """Same format as :meth:`DistributedOptimizer.full_state_dict` (no communication)."""
        return {"step": self.num_steps,
                "state": [[{k: v.clone() for k, v in m.items()} for m in moments] for moments in self.moments]}

    def load_full_state_dict(self, state: dict) -> None:
        _check_full_state(state, self.grads.buffers)
        self.num_steps = int(state["step"])
        for buf, moments, entries in zip(self.grads.buffers, self.moments, state["state"]):
            for p, m, e in zip(buf.params, moments, entries):
                for k in m:
                    m[k].copy_(e[k].to(m[k]))


def build_optimizer(param_groups: ParamGroups, *, distributed: bool, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, bucket_size: int | None = DEFAULT_BUCKET_SIZE):
    """AdamW over data-parallel param groups: ZeRO-1 sharded (``distributed``) or replicated.

    Both results offer ``grads`` (a :class:`DataParallelGrads`), ``zero_grad()``, ``step()``
    (which finishes the gradient reduction first), a settable ``lr``, ``num_steps``,
    ``state_dict()``/``load_state_dict()`` and layout-independent
    ``full_state_dict()``/``load_full_state_dict()``.
    """
    cls = DistributedOptimizer if distributed else ReplicatedOptimizer
    return cls(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size)
