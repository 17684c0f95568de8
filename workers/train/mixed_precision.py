"""bf16 / fp16 mixed precision: the compute dtype and fp16's dynamic loss scaler.

Megatron's recipe, followed here:

* the model's params (and so activations, p2p tensors and TP/SP/CP traffic) are bf16 or fp16;
* every param has an fp32 main copy that the optimizer updates (the distributed optimizer
  keeps only its shard of it), then casts back into the model (``Float16OptimizerWithFloat16Params``);
* gradients accumulate over microbatches and reduce over data parallelism in fp32 main-grad
  buffers (:mod:`workers.parallel.data`, ``grad_dtype=float32``);
* norms' statistics, softmax and the cross-entropy run in fp32 inside the layers;
* fp16 only: the loss is multiplied by a dynamic loss scale before backward; main grads are
  unscaled; a step whose grads hold an inf/nan anywhere is skipped (no update, no LR
  schedule advance) and the scale backs off (:class:`DynamicGradScaler`).
"""

from __future__ import annotations

import torch


def compute_dtype(training) -> torch.dtype:
    """The model's dtype from ``training.bf16`` / ``training.fp16`` (exclusive; fp32 otherwise)."""
    bf16, fp16 = getattr(training, "bf16", False), getattr(training, "fp16", False)
    if bf16 and fp16:
        raise ValueError("training.bf16 and training.fp16 are exclusive; set one of them")
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


class DynamicGradScaler:
    """Megatron's ``DynamicGradScaler`` (megatron/core/optimizer/grad_scaler.py), same rules.

    A step with non-finite grads counts against ``hysteresis``; once that many have been seen
    since the last growth the scale is multiplied by ``backoff_factor`` (never below
    ``min_scale``). After ``growth_interval`` clean steps in a row the scale grows by
    ``growth_factor`` and the hysteresis budget refills. Megatron's defaults: initial
    ``2**32``, min 1, window 1000, hysteresis 2.
    """

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not (initial_scale > 0 and min_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1
                and growth_interval > 0 and hysteresis > 0):
            raise ValueError(f"invalid loss scaler settings: initial {initial_scale}, min {min_scale}, growth "
                             f"{growth_factor}, backoff {backoff_factor}, window {growth_interval}, "
                             f"hysteresis {hysteresis}")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = float(min_scale), growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
