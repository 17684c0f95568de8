"""The learning-rate schedule, exactly as Megatron-Core's ``OptimizerParamScheduler.get_lr``.

Megatron counts schedule "steps" in samples: ``get_optimizer_param_scheduler`` turns
``lr_warmup_iters``, ``lr_decay_iters`` and ``lr_wsd_decay_iters`` into samples by multiplying
by ``global_batch_size`` (``lr_warmup_fraction`` is a fraction of the decay samples), and
after each successful optimizer step ``scheduler.step(increment=global_batch_size)`` adds the
samples just consumed. :meth:`LRSchedule.get_lr` takes that sample count, so every float
operation (including ``inverse-square-root``'s ``max(steps, 1)``) is Megatron's own.

Step indexing, the one thing a trainer must get right:

* The scheduler starts at 0 samples (``step(0)`` in its constructor), the optimizer step of
  iteration 1 runs with that LR, and only then does the scheduler advance. So the LR *applied*
  by 1-based iteration ``k`` is :meth:`LRSchedule.lr_for_iteration` ``(k)`` =
  ``get_lr((k - 1) * global_batch_size)``; in raytron's trainer, whose ``self.iteration`` counts
  completed iterations, that is ``get_lr(self.iteration * global_batch_size)`` before
  ``optimizer.step()``.
* A step skipped by the fp16 loss scaler does not advance Megatron's scheduler: pass the number
  of *successful* updates so far to :meth:`LRSchedule.lr_for_update` instead.
* Megatron's log line and TensorBoard ``learning-rate`` for iteration ``k`` read the optimizer's
  LR *after* ``scheduler.step``, i.e. the LR iteration ``k + 1`` will use:
  :meth:`LRSchedule.logged_lr` ``(k)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Megatron's LR schedule over samples. Build it with :meth:`from_iters`.

    Attributes:
        max_lr: the peak LR (Megatron's ``--lr``).
        min_lr: the floor after decay (``--min-lr``).
        warmup_steps: warmup length in samples (may be fractional with ``lr_warmup_fraction``).
        decay_steps: decay length in samples.
        decay_style: one of :data:`DECAY_STYLES`.
        wsd_decay_steps: length of WSD's annealing phase in samples (WSD only).
        wsd_decay_style: WSD's annealing shape, one of :data:`WSD_DECAY_STYLES`.
        init_lr: the LR warmup starts from (``--lr-warmup-init``).
        global_batch_size: samples per iteration (the scheduler's increment).
    """

    max_lr: float
    min_lr: float = 0.0
    warmup_steps: float = 0
    decay_steps: int
    decay_style: str = "linear"
    wsd_decay_steps: int | None = None
    wsd_decay_style: str = "exponential"
    init_lr: float = 0.0
    global_batch_size: int = 1

    def __post_init__(self) -> None:
        # Megatron asserts these in OptimizerParamScheduler.__init__; here they are user errors.
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"lr_decay_style {self.decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
        if self.wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"lr_wsd_decay_style {self.wsd_decay_style!r} is not one of "
                             f"{', '.join(WSD_DECAY_STYLES)}")
        if self.min_lr < 0 or self.max_lr < self.min_lr:
            raise ValueError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.max_lr}); lower min_lr")
        if self.init_lr > self.max_lr:
            raise ValueError(f"lr_warmup_init {self.init_lr} > lr {self.max_lr}")
        if self.decay_steps <= 0:
            raise ValueError(f"lr_decay_iters must be positive, got {self.decay_steps} samples")
        if self.warmup_steps >= self.decay_steps:
            raise ValueError(f"the warmup ({self.warmup_steps / self.global_batch_size:g} iterations) must be "
                             f"shorter than lr_decay_iters ({self.decay_steps // self.global_batch_size}); "
                             f"shorten the warmup or raise lr_decay_iters")
        if self.decay_style == "WSD":
            if self.wsd_decay_steps is None:
                raise ValueError("lr_decay_style WSD needs lr_wsd_decay_iters (the length of the annealing phase)")
            if not 0 < self.wsd_decay_steps <= self.decay_steps:
                raise ValueError(f"lr_wsd_decay_iters ({self.wsd_decay_steps // self.global_batch_size}) must be "
                                 f"in [1, lr_decay_iters ({self.decay_steps // self.global_batch_size})]")

    @classmethod
    def from_iters(cls, *, lr: float, train_iters: int, global_batch_size: int, min_lr: float = 0.0,
                   lr_warmup_iters: int = 0, lr_warmup_fraction: float | None = None,
                   lr_decay_iters: int | None = None, lr_decay_style: str = "linear",
                   lr_wsd_decay_iters: int | None = None, lr_wsd_decay_style: str = "exponential",
                   lr_warmup_init: float = 0.0) -> "LRSchedule":
        """The schedule Megatron's ``get_optimizer_param_scheduler`` builds for iteration-based training.

        Args:
            lr: peak learning rate.
            train_iters: iterations of the run (the default ``lr_decay_iters``).
            global_batch_size: samples per iteration.
            min_lr: floor after decay.
            lr_warmup_iters: warmup iterations (exclusive with ``lr_warmup_fraction``).
            lr_warmup_fraction: warmup as a fraction of the decay length.
            lr_decay_iters: decay length in iterations; default ``train_iters``.
            lr_decay_style: one of :data:`DECAY_STYLES`.
            lr_wsd_decay_iters: WSD annealing length in iterations (WSD only).
            lr_wsd_decay_style: WSD annealing shape.
            lr_warmup_init: LR at the start of warmup.

        Raises:
            ValueError: on any combination Megatron refuses.
        """
        if lr_warmup_fraction is not None and lr_warmup_iters:
            raise ValueError(f"set only one of lr_warmup_iters ({lr_warmup_iters}) and lr_warmup_fraction "
                             f"({lr_warmup_fraction})")
        decay_iters = train_iters if lr_decay_iters is None else lr_decay_iters
        decay_steps = decay_iters * global_batch_size
        if lr_warmup_fraction is not None:
            warmup_steps = lr_warmup_fraction * decay_steps
        else:
            warmup_steps = lr_warmup_iters * global_batch_size
        wsd_steps = None if lr_wsd_decay_iters is None else lr_wsd_decay_iters * global_batch_size
        return cls(max_lr=float(lr), min_lr=min_lr, warmup_steps=warmup_steps, decay_steps=decay_steps,
                   decay_style=lr_decay_style, wsd_decay_steps=wsd_steps, wsd_decay_style=lr_wsd_decay_style,
                   init_lr=lr_warmup_init, global_batch_size=global_batch_size)

    @classmethod
    def from_config(cls, training) -> "LRSchedule":
        """From a :class:`workers.config.TrainingConfig` (fields with Megatron's names)."""
        t = training
        return cls.from_iters(
            lr=t.lr, train_iters=t.train_iters, global_batch_size=t.global_batch_size, min_lr=t.min_lr,
            lr_warmup_iters=t.lr_warmup_iters, lr_warmup_fraction=t.lr_warmup_fraction,
            lr_decay_iters=t.lr_decay_iters, lr_decay_style=t.lr_decay_style,
            lr_wsd_decay_iters=t.lr_wsd_decay_iters, lr_wsd_decay_style=t.lr_wsd_decay_style,
        )

    def get_lr(self, num_steps: float) -> float:
        """Megatron's ``get_lr`` at ``num_steps`` samples consumed by successful updates."""
        max_lr, min_lr = self.max_lr, self.min_lr
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(num_steps) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return max_lr
        if num_steps > self.decay_steps:
            return min_lr
        if self.decay_style == "inverse-square-root":
            warmup_steps = max(self.warmup_steps, 1)
            steps = max(num_steps, 1)
            return max(min_lr, max_lr * warmup_steps**0.5 / (steps**0.5))
        decay_ratio = float(num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD: stable at max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.decay_steps - self.wsd_decay_steps
            coeff = 1.0 if num_steps <= anneal_start else self._wsd_coeff(
                float(num_steps - anneal_start) / float(self.wsd_decay_steps))
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, ratio: float) -> float:
        if self.wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def lr_for_update(self, completed_updates: int) -> float:
        """The LR of the next optimizer step after ``completed_updates`` successful ones."""
        return self.get_lr(completed_updates * self.global_batch_size)

    def lr_for_iteration(self, iteration: int) -> float:
        """The LR Megatron applies in 1-based ``iteration`` (no skipped steps before it)."""
        if iteration < 1:
            raise ValueError(f"iterations are 1-based, got {iteration}")
        return self.lr_for_update(iteration - 1)

    def logged_lr(self, iteration: int) -> float:
        """The ``learning-rate`` Megatron logs for 1-based ``iteration`` (the LR after its step)."""
        return self.lr_for_update(iteration)
