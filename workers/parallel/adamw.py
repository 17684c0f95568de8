"""AdamW's elementwise math and the step sequence both optimizers share.

:func:`adamw_update` is exactly ``torch.optim.AdamW``'s single-tensor math; :class:`AdamWOverGrads`
holds the hyperparameters, the bucketed data-parallel grads and the step sequence of
Megatron's ``MixedPrecisionOptimizer.step`` (finish the reduction; with a loss scaler, unscale
and skip on overflow; global grad norm and clipping, :mod:`workers.parallel.clip`; update).
The two layouts of the optimizer state live in :mod:`workers.parallel.optimizer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.parallel.clip import clip_by_norm, global_grad_norm, unscale_and_check
from workers.parallel.data import DataParallelGrads, GradBuffer, ParamGroups


def decays(param: torch.Tensor) -> bool:
    """Whether weight decay applies to ``param``: not to 1-D params (norm weights, biases)."""
    return param.dim() > 1


def _check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr ({lr}), eps ({eps}) and weight_decay ({weight_decay}) must be >= 0")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas {tuple(betas)} must each lie in [0, 1), e.g. (0.9, 0.999)")


@torch.no_grad()
def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 decay_mask: torch.Tensor | None = None) -> None:
    """One AdamW step in place: exactly ``torch.optim.AdamW``'s single-tensor math (decoupled
    weight decay, bias correction). Written out rather than calling torch.optim, whose first
    use imports torch._dynamo (~2 CPU-seconds per rank at start-up).

    ``decay_mask`` (bool, ``param``'s shape) limits weight decay to the elements where it is
    True; the decayed elements are scaled by the same float as without a mask.
    """
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    if weight_decay and decay_mask is not None:
        param.mul_(torch.where(decay_mask, torch.tensor(1 - lr * weight_decay, dtype=param.dtype), 1.0))
    elif weight_decay:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


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


class AdamWOverGrads:
    """What both optimizers share: AdamW's hyperparameters, the bucketed grads, the step count,
    and the step sequence (unscale, norm, clip, update)."""

    def __init__(self, param_groups: ParamGroups, lr: float, betas, eps: float, weight_decay: float, *,
                 bucket_size: int | None, shard: bool, param_dtype: torch.dtype | None = None,
                 clip_grad: float = 0.0, grad_scaler=None, tp_rank: int = 0, norm_group=None):
        _check_hparams(lr, betas, eps, weight_decay)
        if clip_grad < 0:
            raise ValueError(f"clip_grad ({clip_grad}) must be >= 0 (0 = no clipping)")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.param_dtype = param_dtype or torch.float32
        self.low_precision = self.param_dtype != torch.float32
        # Built while the params are still fp32 (main copies are taken from them first).
        self.grads = DataParallelGrads(param_groups, bucket_size=bucket_size, shard=shard,
                                       grad_dtype=torch.float32 if self.low_precision else None)
        self.clip_grad, self.grad_scaler, self.tp_rank, self.norm_group = clip_grad, grad_scaler, tp_rank, norm_group
        self.num_steps = 0

    @torch.no_grad()
    def _cast_params(self) -> None:
        """Cast the model's params to ``param_dtype`` once the fp32 main copies exist."""
        if not self.low_precision:
            return
        for buf in self.grads.buffers:
            for p in buf.params:
                p.data = p.data.to(self.param_dtype)
                p.grad = None
            buf.main_grads = True

    def zero_grad(self) -> None:
        self.grads.zero()

    def main_grads(self) -> list[torch.Tensor]:
        """The fp32 grads this rank updates from (flat buffers or their shards)."""
        raise NotImplementedError

    def owned_grads(self):
        """``(param, grad piece)`` this rank counts in the global norm (see workers.parallel.clip)."""
        raise NotImplementedError

    def _apply_updates(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self) -> StepInfo:
        """Finish the reduction, (unscale,) take the norm, clip, update; see the module docstring."""
        self.grads.finish()
        if self.grad_scaler is not None:
            found_inf = unscale_and_check(self.main_grads(), self.grad_scaler.inv_scale, self.norm_group)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return StepInfo(grad_norm=None, skipped=True)
        norm = global_grad_norm(self.owned_grads(), tp_rank=self.tp_rank, group=self.norm_group)
        if not math.isfinite(norm):
            # Keep the weights finite; the caller sees the norm and fails the job.
            return StepInfo(grad_norm=norm, skipped=True)
        if self.clip_grad > 0:
            clip_by_norm(self.main_grads(), self.clip_grad, norm)
        self.num_steps += 1
        self._apply_updates()
        return StepInfo(grad_norm=norm, skipped=False)

    def _update(self, param, grad, exp_avg, exp_avg_sq, *, decay: bool = True, decay_mask=None) -> None:
        adamw_update(param, grad, exp_avg, exp_avg_sq, step=self.num_steps, lr=self.lr, betas=self.betas,
                     eps=self.eps, weight_decay=self.weight_decay if decay else 0.0, decay_mask=decay_mask)


def check_full_state(state: dict, buffers: list[GradBuffer]) -> None:
    want = [[tuple(p.shape) for p in buf.params] for buf in buffers]
    got = [[tuple(e["exp_avg"].shape) for e in group] for group in state["state"]]
    if want != got:
        raise ValueError(f"optimizer state holds params of shapes {got}, this model has {want}")
