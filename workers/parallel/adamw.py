"""AdamW's elementwise math and the step sequence both optimizers share.

:class:`FlatAdamW` runs ``torch.optim.AdamW``'s math (fused: ``torch._fused_adamw_``) over flat
fp32 buffers, a couple of calls per step rather than ~9 kernels per param; :class:`AdamWOverGrads`
holds the hyperparameters, the bucketed data-parallel grads and the step sequence of
Megatron's ``MixedPrecisionOptimizer.step`` (finish the reduction; with a loss scaler, unscale
and skip on overflow; global grad norm and clipping, :mod:`workers.parallel.clip`; update).
The two layouts of the optimizer state live in :mod:`workers.parallel.optimizer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.parallel.clip import clip_by_norm, global_grad_norm_tensor, unscale_and_check
from workers.parallel.data import DataParallelGrads, GradBuffer, ParamGroups


def decays(param: torch.Tensor) -> bool:
    """Whether weight decay applies to ``param``: not to 1-D params (norm weights, biases)."""
    return param.dim() > 1


def _check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas {tuple(betas)} must each lie in [0, 1), e.g. (0.9, 0.999)")


def decay_runs(pieces, n: int, cuts=()) -> list[tuple[int, int, bool]]:
    """Split a flat buffer of ``n`` elements into maximal runs of elements that do / do not decay.

    Built from the params' ranges, not from a per-element mask (a bool mask is 1 byte per
    element: a quarter of the fp32 params, transient or, kept, for good).

    Args:
        pieces: ``(start, end, decays)`` of each param's range in the buffer, any order,
            disjoint; elements no piece covers (bucket padding) do not decay.
        n: the buffer's length.
        cuts: positions where a run must end even if the next one is alike (bucket bounds).

    Returns:
        ``[(start, end, decays), ...]`` covering ``[0, n)`` in order.
    """
    runs: list[list] = []
    pos = 0
    for a, b, d in sorted((a, b, bool(d)) for a, b, d in pieces if b > a):
        for lo, hi, dec in ((pos, a, False), (a, b, d)):
            if hi <= lo:
                continue
            if runs and runs[-1][2] == dec:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, dec])
        pos = b
    if pos < n:
        if runs and not runs[-1][2]:
            runs[-1][1] = n
        else:
            runs.append([pos, n, False])
    out = []
    cuts = sorted(set(cuts))
    for a, b, d in runs:
        inner = [c for c in cuts if a < c < b]
        for lo, hi in zip([a, *inner], [*inner, b]):
            out.append((lo, hi, d))
    return out


class FlatAdamW:
    """AdamW over flat fp32 buffers through ``torch._fused_adamw_``: one call per decay class.

    The fused op takes one weight decay per call, so the flat range is cut into runs of params
    that decay and runs that do not (:func:`decay_runs`, a handful per layer), passed as lists of
    views: two calls per step, whatever the number of params. The op is elementwise and its
    result does not depend on where a run starts (checked bitwise), so a ZeRO shard updates its
    elements exactly as the single process does. ``torch._fused_adamw_`` is an aten op: calling
    it does not import ``torch.optim`` / ``torch._dynamo`` (~2 CPU-seconds per rank at start-up).

    Args:
        param, grad, exp_avg, exp_avg_sq: flat fp32 buffers of one length (live: views are kept).
        runs: :func:`decay_runs` of the buffer (which elements weight decay applies to).
        grad_at, param_at: ``grad_at(a, b)``, the grads of elements ``[a, b)`` (no run may
            cross a piece it cannot view); default ``grad[a:b]``, and so for the params. The
            distributed optimizer's grads are its slices of the buckets, in place in the gradient
            buffer; its fp32 params, its slices of the model's flat param buffer.
    """

    def __init__(self, param: torch.Tensor | None, grad: torch.Tensor | None, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, runs: list[tuple[int, int, bool]], grad_at=None, param_at=None):
        grad_at = grad_at or (lambda a, b: grad[a:b])
        param_at = param_at or (lambda a, b: param[a:b])
        self.groups = {}
        for decay in (True, False):
            runs_of = [(a, b) for a, b, d in runs if d == decay]
            self.groups[decay] = [[param_at(a, b) for a, b in runs_of], [grad_at(a, b) for a, b in runs_of],
                                  [exp_avg[a:b] for a, b in runs_of], [exp_avg_sq[a:b] for a, b in runs_of]]
        # The op reads the step count per tensor from a (float) tensor.
        self.step_t = torch.zeros((), dtype=torch.float32, device=exp_avg.device)

    @torch.no_grad()
    def update(self, *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
               grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """One AdamW step in place (decoupled weight decay, bias correction, as torch.optim's).

        Args:
            grad_scale: the op divides the grads by it (and leaves them so); None: no scaling.
            found_inf: a float32 one-element device tensor; where it holds 1.0 the op leaves
                params and moments untouched (the skip decided on the device, no host read).
        """
        self.step_t.fill_(step)
        for decay, (params, grads, exp_avgs, exp_avg_sqs) in self.groups.items():
            if params:
                if grads[0].dtype != params[0].dtype:  # fp64 main grads: the step is fp32
                    grads = [g.to(params[0].dtype) for g in grads]
                torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [self.step_t] * len(params),
                                    lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay if decay else 0.0,
                                    eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                                    found_inf=found_inf)


@dataclass(frozen=True)
class StepInfo:
    """What one :meth:`step` did.

    Attributes:
        grad_norm: the global L2 norm of the (unscaled, unclipped) gradient; ``None`` when a
            loss-scaler overflow skipped the step before the norm (Megatron reports none then).
        skipped: no update happened (fp16 overflow, or a non-finite norm).
    """

    grad_norm: float | None
    skipped: bool


@dataclass(frozen=True)
class PendingStep:
    """What :meth:`AdamWOverGrads.step_on_device` did, still on the device: float64 ``[1]``
    tensors the caller reads to the host together with its own scalars (one sync per
    iteration), then hands to :meth:`AdamWOverGrads.finish_step`.

    Attributes:
        grad_norm: the global grad norm (unscaled, unclipped); meaningless on an overflow.
        skipped: 1.0 if the update was skipped (fp16 overflow or a non-finite norm), else 0.0.
        found_inf: 1.0 if the loss scaler found an inf/nan (0.0 without a scaler).
    """

    grad_norm: torch.Tensor
    skipped: torch.Tensor
    found_inf: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.grad_norm, self.skipped, self.found_inf]


class AdamWOverGrads:
    """What both optimizers share: AdamW's hyperparameters, the bucketed grads, the step count,
    and the step sequence (unscale, norm, clip, update)."""

    def __init__(self, param_groups: ParamGroups, lr: float, betas, eps: float, weight_decay: float, *,
                 bucket_size: int | None, shard: bool, param_dtype: torch.dtype | None = None,
                 clip_grad: float = 0.0, grad_scaler=None, tp_rank: int = 0, norm_group=None,
                 main_grads_dtype: torch.dtype = torch.float32):
        _check_hparams(lr, betas, eps, weight_decay)
        if clip_grad < 0:
            raise ValueError(f"clip_grad ({clip_grad}) must be >= 0 (0 = no clipping)")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.param_dtype = param_dtype or torch.float32
        self.low_precision = self.param_dtype != torch.float32
        # Built while the params are still fp32 (the optimizers take main copies, then cast).
        self.grads = DataParallelGrads(param_groups, bucket_size=bucket_size, shard=shard,
                                       grad_dtype=main_grads_dtype)
        self.clip_grad, self.grad_scaler, self.tp_rank, self.norm_group = clip_grad, grad_scaler, tp_rank, norm_group
        self.num_steps = 0
        self._found_inf: torch.Tensor | None = None  # set during step_on_device

    def zero_grad(self) -> None:
        self.grads.zero()

    def wait_params(self, params) -> None:
        """Finish the param all-gathers in flight for ``params`` (only the distributed optimizer
        with ``overlap_param_gather`` has any)."""

    def finish_param_gather(self) -> None:
        """Finish every param all-gather in flight (see :meth:`wait_params`)."""

    def hook_param_gather(self, modules) -> list:
        """Forward pre-hooks that wait for the params' all-gather (none here)."""
        return []

    def main_grads(self) -> list[torch.Tensor]:
        """The fp32 grads this rank updates from (flat buffers or their shards)."""
        raise NotImplementedError

    def owned_grads(self):
        """``(param, grad piece)`` this rank counts in the global norm (see workers.parallel.clip)."""
        raise NotImplementedError

    def _apply_updates(self, grad_scale: torch.Tensor | None) -> None:
        """Update every param; ``grad_scale`` (or None) divides the grads first (see FlatAdamW)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self) -> StepInfo:
        """Finish the reduction, (unscale,) take the norm, clip, update; see the module docstring.
        Reads the outcome to the host once (:meth:`step_on_device` + :meth:`finish_step`)."""
        pending = self.step_on_device()
        grad_norm, skipped, found_inf = torch.cat(pending.tensors()).tolist()
        return self.finish_step(grad_norm, skipped, found_inf)

    @torch.no_grad()
    def step_on_device(self) -> PendingStep:
        """The step without a host read: the skip (fp16 overflow, non-finite norm) is decided on
        the device and applied by the fused AdamW's ``found_inf``; clipping multiplies by a
        device coefficient. :meth:`finish_step` must follow with the values read."""
        self.grads.finish()
        grads = self.main_grads()
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        if self.grad_scaler is not None:
            found_inf = unscale_and_check(grads, self.grad_scaler.inv_scale, self.norm_group)
        norm = global_grad_norm_tensor(self.owned_grads(), tp_rank=self.tp_rank, group=self.norm_group)
        # A non-finite norm skips the update too: the weights stay finite and the caller,
        # reading the norm, fails the job.
        skip = torch.maximum(found_inf, (~torch.isfinite(norm)).float().to(device))
        if self.clip_grad > 0:
            # A separate multiply over the flat grads, not the fused op's grad_scale: on CPU the
            # op's grad_scale path took 2x its plain time (measured, bench/step_bench.py).
            clip_by_norm(grads, self.clip_grad, norm)
        self._found_inf = skip
        try:
            self._apply_updates(None)
        finally:
            self._found_inf = None
        return PendingStep(grad_norm=norm.to(device), skipped=skip.double(), found_inf=found_inf.double())

    def finish_step(self, grad_norm: float, skipped: float, found_inf: float) -> StepInfo:
        """The host side of a step from :meth:`step_on_device`'s values, read: the successful
        update count (the LR schedule's position) and the loss scaler advance."""
        if self.grad_scaler is not None:
            self.grad_scaler.update(bool(found_inf))
        if not skipped:
            self.num_steps += 1
        return StepInfo(grad_norm=None if found_inf else grad_norm, skipped=bool(skipped))

    def _update(self, flat: FlatAdamW, grad_scale: torch.Tensor | None) -> None:
        # The update counts as step num_steps + 1; num_steps itself advances in finish_step,
        # once the host knows the update was not skipped.
        flat.update(step=self.num_steps + 1, lr=self.lr, betas=self.betas, eps=self.eps,
                    weight_decay=self.weight_decay, grad_scale=grad_scale, found_inf=self._found_inf)


def check_full_state(state: dict, buffers: list[GradBuffer]) -> None:
    want = [[tuple(p.shape) for p in buf.params] for buf in buffers]
    got = [[tuple(e["exp_avg"].shape) for e in group] for group in state["state"]]
    if want != got:
        raise ValueError(f"optimizer state holds params of shapes {got}, this model has {want}")
