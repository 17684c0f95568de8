"""The two layouts of the AdamW state over the data-parallel gradient buffers: replicated, or
ZeRO-1 sharded.

:class:`ReplicatedOptimizer` is the plain path (all-reduced buckets, AdamW on the full
params). :class:`DistributedOptimizer` (Megatron's distributed optimizer, ZeRO-1) keeps the Adam
moments of this rank's 1/n slice of every reduce-scattered bucket, updates the params of that
slice in place in the model's flat param buffer (in fp32 they are the main params themselves)
and all-gathers each bucket in place in that buffer (its full state dict's gather and scatter
of the moments: :mod:`workers.parallel.zero_state`). Both are built by :func:`build_optimizer`
and share, from
:mod:`workers.parallel.adamw`, the elementwise math (:class:`~workers.parallel.adamw.FlatAdamW`:
``torch.optim.AdamW``'s, fused over flat buffers), the rule that weight decay never touches 1-D parameters (norm
weights, biases: decaying a norm's scale towards 0 only fights the normalisation; as Megatron)
and the step sequence of :class:`~workers.parallel.adamw.AdamWOverGrads` (Megatron's
``MixedPrecisionOptimizer.step``): finish the gradient reduction; with a loss scaler, unscale
the main grads and skip the step if any rank found an inf/nan; take the global grad norm
(:mod:`workers.parallel.clip`) and clip by it (``clip_grad > 0``); update.

With ``param_dtype`` bf16/fp16 the params are cast to it, the optimizer keeps their fp32 main
copy (the distributed optimizer: its shard of it, rounded into the model's after each update)
and grads accumulate in fp32 buffers. Both optimizers make the model params views of flat
buffers laid out as the gradient buffers.
"""

from __future__ import annotations

import torch

from workers.parallel.adamw import AdamWOverGrads, FlatAdamW, StepInfo, check_full_state, decay_runs, decays  # noqa: F401
from workers.parallel.data import DEFAULT_BUCKET_SIZE, GradBuffer, ParamGroups
from workers.parallel.param_gather import ParamGather
from workers.parallel.zero_state import gather_moments, scatter_moments


class DistributedOptimizer(ParamGather, AdamWOverGrads):
    """ZeRO-1 AdamW: each rank keeps the Adam moments (and, bf16/fp16, the fp32 main params) of
    its 1/n shard; per-rank optimizer memory is ~1/n of the model's.

    The math is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction), applied
    elementwise to the flat shard. As Megatron-Core's distributed optimizer, the model params are
    views of one flat param buffer per group, laid out as the gradient buffer (padding
    included, :attr:`param_buffers`). In fp32 the main params of this rank's shard *are* its
    slices of that buffer (no master copy, nothing copied per step); in bf16/fp16 an fp32 main
    shard is kept and copied (rounded) into those slices after the update. Each bucket's
    all-gather then runs in place in the param buffer, from this rank's slice of it (none at
    group size 1; :class:`~workers.parallel.param_gather.ParamGather`).

    Args:
        param_groups: ``[(params, group), ...]`` as for :class:`DataParallelGrads`.
        lr, betas, eps, weight_decay: AdamW's hyperparameters (``lr`` may be reassigned).
        bucket_size: elements per gradient bucket.
        overlap_param_gather: leave the all-gathers in flight after a step, each bucket's
            waited for by :meth:`wait_params` (the next forward's pre-hooks).
    """

    def __init__(self, param_groups: ParamGroups, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, bucket_size: int | None = DEFAULT_BUCKET_SIZE,
                 overlap_param_gather: bool = False, **kwargs):
        super().__init__(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size, shard=True, **kwargs)
        self.overlap_param_gather = overlap_param_gather
        self._gathering = {}  # id(param) -> its bucket's all-gather in flight (ParamGather)
        self.shards, self.param_buffers, self.flat = [], [], []
        for buf in self.grads.buffers:
            n = buf.numel // buf.num_ranks
            shard = {k: torch.zeros(n, dtype=torch.float32, device=buf.grad.device) for k in ("exp_avg", "exp_avg_sq")}
            if self.low_precision:  # the fp32 main shard, from the fp32 params before they are cast
                shard["param"] = torch.zeros(n, dtype=torch.float32, device=buf.grad.device)
                for p, a, b, s in buf.pieces():
                    shard["param"][s : s + b - a].copy_(p.detach().reshape(-1)[a:b])
            pbuf = self._flatten_params(buf)
            # Which shard elements belong to params that decay (padding never matters: grad 0).
            # Grads and fp32 params are this rank's slices of the buckets, in place: runs end at
            # bucket bounds.
            runs = decay_runs(((s0, s0 + b - a, decays(p)) for p, a, b, s0 in buf.pieces()), n,
                              cuts=buf.shard_bounds())
            param_at = None if self.low_precision else (lambda a, b, buf=buf, pbuf=pbuf: buf.shard_view(a, b, pbuf))
            self.flat.append(FlatAdamW(shard.get("param"), None, shard["exp_avg"], shard["exp_avg_sq"], runs,
                                       grad_at=buf.shard_view, param_at=param_at))
            self.shards.append(shard)
            self.param_buffers.append(pbuf)

    @torch.no_grad()
    def _flatten_params(self, buf: GradBuffer) -> torch.Tensor:
        """The group's flat param buffer in ``param_dtype`` (cast on the way in, see
        :func:`_move_into`; zeros in the bucket padding)."""
        pbuf = _move_into(buf, torch.zeros(buf.numel, dtype=self.param_dtype, device=buf.grad.device))
        buf.main_grads = buf.grad.dtype != self.param_dtype
        if buf.main_grads:
            for p in buf.params:
                p.grad = None  # grads accumulate into the main grads
        return pbuf

    def _owned(self, i: int):
        """``(model slice, main shard slice or None)`` of this rank, bucket by bucket, group ``i``."""
        buf, pbuf, main = self.grads.buffers[i], self.param_buffers[i], self.shards[i].get("param")
        for lo, hi, base in map(buf.shard_range, buf.buckets):
            yield pbuf[lo:hi], None if main is None else main[base : base + hi - lo]

    def main_grads(self) -> list[torch.Tensor]:
        return [view for buf in self.grads.buffers for view in buf.shard_views]

    def owned_grads(self):
        for buf in self.grads.buffers:
            for p, a, b, s in buf.pieces():
                yield p, buf.shard_view(s, s + b - a)

    def _apply_updates(self, grad_scale) -> None:
        """Update this rank's shard of the main params (bf16/fp16: then round it into the model's
        param buffer), all-gather the model params in place."""
        self.finish_param_gather()
        for i, (buf, flat) in enumerate(zip(self.grads.buffers, self.flat)):
            self._update(flat, grad_scale)
            if self.low_precision:
                for model, main in self._owned(i):
                    model.copy_(main)  # the one rounding copy
            self._gather_params(buf, self.param_buffers[i])

    def state_dict(self) -> dict:
        """This rank's sharded state (valid only for the same layout: group sizes, buckets): the
        moments and main params of its shard (fp32: a copy of its slices of the param buffer)."""
        self.finish_param_gather()
        shards = [{k: v.clone() for k, v in s.items()} for s in self.shards]
        if not self.low_precision:
            for i, s in enumerate(shards):
                s["param"] = torch.cat([model for model, _ in self._owned(i)] or [self.param_buffers[i][:0]])
        return {"step": self.num_steps, "numel": [buf.numel for buf in self.grads.buffers],
                "num_ranks": [buf.num_ranks for buf in self.grads.buffers], "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict` output; in fp32 its main params are not read: the model params
        are the main params and must hold the matching weights already."""
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
        return {"step": self.num_steps,
                "state": [gather_moments(buf, shard) for buf, shard in zip(self.grads.buffers, self.shards)]}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load :meth:`full_state_dict` output (from any layout); the model params must hold
        the matching weights already (they are, or bf16/fp16 give, the main params)."""
        self.finish_param_gather()
        check_full_state(state, self.grads.buffers)
        self.num_steps = int(state["step"])
        for g, (buf, shard, entries) in enumerate(zip(self.grads.buffers, self.shards, state["state"])):
            for model, main in self._owned(g):
                if main is not None:  # bf16/fp16: the main shard from the model's weights
                    main.copy_(model)
            scatter_moments(buf, shard, entries)


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
            # The params move into the flat main buffer (never held twice; nor a per-element
            # decay mask: runs come from the offsets).
            master = _move_into(buf, torch.empty(buf.numel, dtype=torch.float32, device=buf.grad.device))
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
            buf.main_grads = buf.grad.dtype != self.param_dtype
            if buf.main_grads:
                for p in buf.params:
                    p.grad = None

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


@torch.no_grad()
def _move_into(buf: GradBuffer, flat: torch.Tensor) -> torch.Tensor:
    """Copy (cast) each param of ``buf`` into its slice of ``flat`` (laid out as the gradient
    buffer) and re-point it at that slice at once: its own storage is freed before the next is
    copied, so moving never holds the params twice. Returns ``flat``."""
    for p in buf.params:
        view = _view(buf, flat, p)
        view.copy_(p.detach())
        p.data = view
    return flat


def _view(buf: GradBuffer, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``p``'s slice of a flat buffer laid out as ``buf``'s gradient buffer, shaped as ``p``."""
    a = buf.offsets[id(p)]
    return flat[a : a + p.numel()].view_as(p)


def build_optimizer(param_groups: ParamGroups, *, distributed: bool, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 0.0, bucket_size: int | None = DEFAULT_BUCKET_SIZE,
                    param_dtype: torch.dtype | None = None, clip_grad: float = 0.0, grad_scaler=None,
                    tp_rank: int = 0, norm_group=None, overlap_param_gather: bool = False,
                    main_grads_dtype: torch.dtype = torch.float32):
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
        grad_scaler: fp16's :class:`workers.train.mixed_precision.DynamicGradScaler` (the caller
            multiplies the loss by its ``scale``); ``None``: no loss scaling.
        main_grads_dtype: the gradient buffers' dtype (accumulation and reduction, see
            :mod:`workers.parallel.data`); float64 makes the sums exact in any order, the step
            casts them to fp32.
        tp_rank: this rank's TP rank (TP duplicates are counted once in the norm).
        norm_group: every rank of the job, over which the norm and overflow flag are reduced.
        overlap_param_gather: (distributed) the updated params' all-gather runs under the next
            forward; the caller installs :meth:`DistributedOptimizer.hook_param_gather`.
    """
    extra = {"overlap_param_gather": overlap_param_gather} if distributed else {}
    cls = DistributedOptimizer if distributed else ReplicatedOptimizer
    return cls(param_groups, lr, betas, eps, weight_decay, bucket_size=bucket_size, param_dtype=param_dtype,
               clip_grad=clip_grad, grad_scaler=grad_scaler, tp_rank=tp_rank, norm_group=norm_group,
               main_grads_dtype=main_grads_dtype, **extra)
