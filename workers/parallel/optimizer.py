"""The two layouts of the AdamW state over the data-parallel gradient buffers: replicated, or
ZeRO-1 sharded.

:class:`ReplicatedOptimizer` is the plain path (all-reduced buckets, AdamW on the full
params). :class:`DistributedOptimizer` (Megatron's distributed optimizer, ZeRO-1) keeps the fp32
master copy and Adam moments of this rank's 1/n slice of every reduce-scattered bucket and
all-gathers the updated params. Both are built by :func:`build_optimizer` and share, from
:mod:`workers.parallel.adamw`, the elementwise math (:class:`~workers.parallel.adamw.FlatAdamW`:
``torch.optim.AdamW``'s, fused over flat buffers), the rule that weight decay never touches 1-D parameters (norm
weights, biases: decaying a norm's scale towards 0 only fights the normalisation; as Megatron)
and the step sequence of :class:`~workers.parallel.adamw.AdamWOverGrads` (Megatron's
``MixedPrecisionOptimizer.step``): finish the gradient reduction; with a loss scaler, unscale
the main grads and skip the step if any rank found an inf/nan; take the global grad norm
(:mod:`workers.parallel.clip`) and clip by it (``clip_grad > 0``); update.

With ``param_dtype`` bf16/fp16 the params are cast to it, the optimizer keeps their fp32 main
copy (the distributed optimizer: its shard of it) and grads accumulate in fp32 buffers.
"""

from __future__ import annotations

import torch

from workers.parallel import comm
from workers.parallel.adamw import AdamWOverGrads, FlatAdamW, StepInfo, check_full_state, decay_runs, decays  # noqa: F401
from workers.parallel.data import DEFAULT_BUCKET_SIZE, GradBuffer, ParamGroups


class DistributedOptimizer(AdamWOverGrads):
    """ZeRO-1 AdamW: each rank keeps the fp32 master params and Adam moments of its 1/n shard.

    The math is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction), applied
    elementwise to the flat shard, so per-rank optimizer memory is ~1/n of the model's.

    Args:
        param_groups: ``[(params, group), ...]`` as for :class:`DataParallelGrads`.
        lr, betas, eps, weight_decay: AdamW's hyperparameters (``lr`` may be reassigned).
        bucket_size: elements per gradient bucket.
    """

    def __init__(self, param_groups: ParamGroups, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, bucket_size: int | None = DEFAULT_BUCKET_SIZE,
                 overlap_param_gather: bool = False, **kwargs):
        super().__init__(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size, shard=True, **kwargs)
        self.overlap_param_gather = overlap_param_gather
        self._gathering: dict[int, _Gathering] = {}  # id(param) -> its bucket's all-gather in flight
        self.shards = []
        for buf in self.grads.buffers:
            n = buf.numel // buf.num_ranks
            master = torch.zeros(n, dtype=torch.float32, device=buf.grad.device)
            self.shards.append({"param": master, "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)})
            self._load_master(buf, master)
        # Which shard elements belong to params that decay (padding never matters: grad 0).
        # The grads are this rank's slices of the buckets, in place: runs end at bucket bounds.
        self.flat = [FlatAdamW(s["param"], None, s["exp_avg"], s["exp_avg_sq"],
                               decay_runs(((s0, s0 + b - a, decays(p)) for p, a, b, s0 in buf.pieces()),
                                          s["param"].numel(), cuts=buf.shard_bounds()), grad_at=buf.shard_view)
                     for buf, s in zip(self.grads.buffers, self.shards)]
        self._cast_params()

    @staticmethod
    @torch.no_grad()
    def _load_master(buf: GradBuffer, master: torch.Tensor) -> None:
        for p, a, b, s in buf.pieces():
            master[s : s + b - a].copy_(p.detach().reshape(-1)[a:b])

    def main_grads(self) -> list[torch.Tensor]:
        return [view for buf in self.grads.buffers for view in buf.shard_views]

    def owned_grads(self):
        for buf in self.grads.buffers:
            for p, a, b, s in buf.pieces():
                yield p, buf.shard_view(s, s + b - a)

    def _apply_updates(self, grad_scale) -> None:
        """Update this rank's shard of the fp32 main params, all-gather the model params."""
        self.finish_param_gather()
        for buf, state, flat in zip(self.grads.buffers, self.shards, self.flat):
            if not self.low_precision:
                # fp32 params hold exactly the master values; re-reading them keeps the master
                # right if model weights were loaded after this optimizer was built.
                self._load_master(buf, state["param"])
            self._update(flat, grad_scale)
            self._gather_params(buf, state["param"])

    def _gather_params(self, buf: GradBuffer, master: torch.Tensor) -> None:
        # Gathered in the params' dtype: bf16 halves the traffic (Megatron gathers model params).
        if self.overlap_param_gather:
            self._start_gather(buf, master)
            return
        scratch = torch.empty(max((b.end - b.start for b in buf.buckets), default=0), dtype=self.param_dtype,
                              device=buf.grad.device)
        for bucket in buf.buckets:
            lo, hi, base = buf.shard_range(bucket)
            full = scratch[: bucket.end - bucket.start]
            comm.all_gather_into(full, master[base : base + hi - lo].to(self.param_dtype), buf.group)
            for p in bucket.params:
                a = buf.offsets[id(p)] - bucket.start
                p.detach().copy_(full[a : a + p.numel()].view_as(p))

    def _start_gather(self, buf: GradBuffer, master: torch.Tensor) -> None:
        """Start every bucket's all-gather, the first layers' first (buckets hold the params in
        reverse order), each into a buffer of its own; :meth:`wait_params` finishes them."""
        for bucket in reversed(buf.buckets):
            lo, hi, base = buf.shard_range(bucket)
            full = torch.empty(bucket.end - bucket.start, dtype=self.param_dtype, device=buf.grad.device)
            work = comm.all_gather_into(full, master[base : base + hi - lo].to(self.param_dtype), buf.group,
                                        async_op=True)
            gathering = _Gathering(buf, bucket, full, work)
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

    @torch.no_grad()
    def _finish(self, g: "_Gathering") -> None:
        comm.wait(g.work)
        for p in g.bucket.params:
            a = g.buf.offsets[id(p)] - g.bucket.start
            p.detach().copy_(g.full[a : a + p.numel()].view_as(p))
            del self._gathering[id(p)]

    def hook_param_gather(self, modules) -> list:
        """With ``overlap_param_gather``: a forward pre-hook on every module of ``modules`` (and
        their submodules) that holds params, waiting for its params' all-gather; returns the
        handles (empty without overlap)."""
        if not self.overlap_param_gather:
            return []
        return [m.register_forward_pre_hook(lambda mod, args: self.wait_params(mod.parameters(recurse=False)))
                for root in modules for m in root.modules() if next(m.parameters(recurse=False), None) is not None]

    def state_dict(self) -> dict:
        """This rank's sharded state (valid only for the same layout: group sizes, buckets)."""
        self.finish_param_gather()
        return {"step": self.num_steps, "numel": [buf.numel for buf in self.grads.buffers],
                "num_ranks": [buf.num_ranks for buf in self.grads.buffers],
                "shards": [{k: v.clone() for k, v in s.items()} for s in self.shards]}

    def load_state_dict(self, state: dict) -> None:
        self.finish_param_gather()
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
        self.finish_param_gather()
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
        self.finish_param_gather()
        check_full_state(state, self.grads.buffers)
        self.num_steps = int(state["step"])
        for buf, shard, entries in zip(self.grads.buffers, self.shards, state["state"]):
            index = {id(p): i for i, p in enumerate(buf.params)}
            self._load_master(buf, shard["param"])
            for p, a, b, s in buf.pieces():
                for key in ("exp_avg", "exp_avg_sq"):
                    shard[key][s : s + b - a].copy_(entries[index[id(p)]][key].reshape(-1)[a:b])


class ReplicatedOptimizer(AdamWOverGrads):
    """The plain data-parallel path: all-reduced buckets + AdamW on the full params.

    Same interface as :class:`DistributedOptimizer` (and the same math, :class:`FlatAdamW`);
    every rank holds the full state.

    The fp32 main params and both moments are flat buffers laid out as the gradient buffer, so
    one fused AdamW covers them all (per-param ``moments`` / ``masters`` are views into them,
    what checkpoints read and write). In fp32 the model params become views of the main buffer
    themselves; in bf16/fp16 views of a flat low-precision copy, refreshed by one ``copy_``.
    """

    def __init__(self, param_groups: ParamGroups, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, bucket_size: int | None = DEFAULT_BUCKET_SIZE, **kwargs):
        super().__init__(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size, shard=False, **kwargs)
        self.moments, self.masters, self.flat, self.flat_masters, self.flat_models = [], [], [], [], []
        for buf in self.grads.buffers:
            # Param by param into the flat main buffer, each param re-pointed at its slice at
            # once: its own storage is freed before the next is copied, so building this never
            # holds the params twice (nor a per-element decay mask: runs come from the offsets).
            master = torch.empty(buf.numel, dtype=torch.float32, device=buf.grad.device)
            with torch.no_grad():
                for p in buf.params:
                    view = _view(buf, master, p)
                    view.copy_(p.detach())
                    p.data = view
            exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
            runs = decay_runs(((buf.offsets[id(p)], buf.offsets[id(p)] + p.numel(), decays(p)) for p in buf.params),
                              buf.numel)
            model = master.to(self.param_dtype) if self.low_precision else master
            self.moments.append([{"exp_avg": _view(buf, exp_avg, p), "exp_avg_sq": _view(buf, exp_avg_sq, p)}
                                 for p in buf.params])
            self.masters.append([_view(buf, master, p) for p in buf.params] if self.low_precision else list(buf.params))
            self.flat.append(FlatAdamW(master, buf.grad, exp_avg, exp_avg_sq, runs))
            self.flat_masters.append(master)
            self.flat_models.append(model)
            for p in buf.params:
                p.data = _view(buf, model, p)  # the fused update writes the params in place
                if self.low_precision:
                    p.grad = None
            buf.main_grads = self.low_precision

    def main_grads(self) -> list[torch.Tensor]:
        return [buf.grad for buf in self.grads.buffers]

    def owned_grads(self):
        # Every rank of the reduction group holds the same sum: its rank 0 counts it.
        for buf in self.grads.buffers:
            if buf.rank == 0:
                yield from ((p, buf.view(p)) for p in buf.params)

    def _apply_updates(self, grad_scale) -> None:
        for flat, master, model in zip(self.flat, self.flat_masters, self.flat_models):
            self._update(flat, grad_scale)
            if model is not master:
                model.copy_(master)  # one rounding copy for every bf16/fp16 param

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
        check_full_state(state, self.grads.buffers)
        self.num_steps = int(state["step"])
        for buf, moments, entries in zip(self.grads.buffers, self.moments, state["state"]):
            for p, m, e in zip(buf.params, moments, entries):
                for k in m:
                    m[k].copy_(e[k].to(m[k]))


class _Gathering:
    """One bucket's param all-gather in flight (:meth:`DistributedOptimizer.wait_params`)."""

    __slots__ = ("buf", "bucket", "full", "work")

    def __init__(self, buf: GradBuffer, bucket, full: torch.Tensor, work):
        self.buf, self.bucket, self.full, self.work = buf, bucket, full, work


def _view(buf: GradBuffer, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``p``'s slice of a flat buffer laid out as ``buf``'s gradient buffer, shaped as ``p``."""
    a = buf.offsets[id(p)]
    return flat[a : a + p.numel()].view_as(p)


def build_optimizer(param_groups: ParamGroups, *, distributed: bool, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, bucket_size: int | None = DEFAULT_BUCKET_SIZE,
                    param_dtype: torch.dtype | None = None, clip_grad: float = 0.0, grad_scaler=None,
                    tp_rank: int = 0, norm_group=None, overlap_param_gather: bool = False):
    """AdamW over data-parallel param groups: ZeRO-1 sharded (``distributed``) or replicated.

    Both results offer ``grads`` (a :class:`DataParallelGrads`), ``zero_grad()``, ``step()``
    (which finishes the gradient reduction first and returns a :class:`StepInfo`), a
    settable ``lr``, ``num_steps`` (successful updates), ``state_dict()``/``load_state_dict()``
    and layout-independent ``full_state_dict()``/``load_full_state_dict()``.

    Args:
        param_dtype: cast the (fp32) params to this dtype and keep fp32 main params and
            main grads (bf16/fp16 mixed precision); ``None``: fp32.
        clip_grad: clip the global grad norm to this value; 0: no clipping (the norm is
            computed and reported anyway).
        grad_scaler: fp16's :class:`workers.mixed_precision.DynamicGradScaler` (the caller
            multiplies the loss by its ``scale``); ``None``: no loss scaling.
        tp_rank: this rank's TP rank (TP duplicates are counted once in the norm).
        norm_group: every rank of the job, over which the norm and overflow flag are reduced.
        overlap_param_gather: (distributed) the updated params' all-gather runs under the next
            forward; the caller installs :meth:`DistributedOptimizer.hook_param_gather`.
    """
    extra = {"overlap_param_gather": overlap_param_gather} if distributed else {}
    cls = DistributedOptimizer if distributed else ReplicatedOptimizer
    return cls(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size, param_dtype=param_dtype,
               clip_grad=clip_grad, grad_scaler=grad_scaler, tp_rank=tp_rank, norm_group=norm_group, **extra)
