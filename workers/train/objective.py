"""What the last pipeline stage turns a microbatch's output into: the LM loss (each microbatch's
``sum(token losses) / tokens of the global batch``, or with packed data ``sum(mask x token
losses) / loss tokens of the global batch``) and, with MTP, the multi-token-prediction objective
joined to its gradient (:mod:`workers.model.mtp`)."""

from __future__ import annotations

import torch

from workers.model.mtp import join_loss, valid_tokens
from workers.parallel.cross_entropy import vocab_parallel_cross_entropy


class Objective:
    """``get_input(mb)`` for the first stage and ``loss(mb, output)`` for the loss stage of one
    schedule run over ``microbatch(mb)`` (``(tokens, labels)`` or a packed ``LocalBatch``)."""

    def __init__(self, trainer, microbatch, denominator, *, loss_scale: float = 1.0, forward_only: bool = False):
        self.trainer, self.microbatch, self.denominator = trainer, microbatch, denominator
        self.loss_scale, self.forward_only = loss_scale, forward_only
        self.labels: dict[int, torch.Tensor] = {}

    def get_input(self, mb: int) -> torch.Tensor:
        tokens, self.labels[mb] = self.microbatch(mb)[:2]
        return tokens

    def loss(self, mb: int, out) -> torch.Tensor:
        t = self.trainer
        logits, hidden = out if isinstance(out, tuple) else (out, None)  # (logits, hidden): MTP
        target = self.labels.pop(mb) if mb in self.labels else self.microbatch(mb)[1]
        # The cross-entropy runs in fp32 whatever the compute dtype (as Megatron's), inside.
        losses = vocab_parallel_cross_entropy(logits, target, t.groups.tp_group)
        if t.packed:
            losses = losses * self.microbatch(mb).loss_mask
        loss = losses.sum() / self.denominator
        if hidden is not None and not self.forward_only:
            loss = join_loss(loss, self.mtp(mb, hidden))
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def mtp(self, mb: int, hidden: torch.Tensor) -> torch.Tensor:
        """Microbatch ``mb``'s share of ``factor / D * sum_k L_k``; its share of the mean of the
        ``L_k`` is added to the trainer's ``mtp_loss_sum`` for the report."""
        t = self.trainer
        m = t.job.model
        read = lambda start, count: t.sampler.batch(t.iteration, start, count)  # noqa: E731
        sums = t.chunks[-1].mtp_losses(hidden, t.local_slice(read, mb, mtp=True))
        per_depth = sums / torch.tensor(valid_tokens(m.seq_length, t.job.training.global_batch_size,
                                                     m.mtp_num_layers), dtype=sums.dtype, device=sums.device)
        t.mtp_loss_sum += per_depth.detach().sum().double() / m.mtp_num_layers
        return per_depth.sum() * (m.mtp_loss_scaling_factor / m.mtp_num_layers)


def trainer_state(t) -> dict:
    """JSON-able trainer state beside a checkpoint's tensors: data position, successful updates (the
    LR schedule's position, Megatron's ``num_steps`` / global batch), skipped steps and the fp16
    loss scaler (:func:`load_trainer_state` restores them)."""
    return {"sampler": t.sampler.state_dict(), "optimizer_steps": t.optimizer.num_steps, "lr": t.optimizer.lr,
            "lr_schedule": {"completed_updates": t.optimizer.num_steps,
                            "next_lr": t.lr_schedule.lr_for_update(t.optimizer.num_steps)},
            "num_skipped": t.num_skipped,
            "grad_scaler": t.grad_scaler.state_dict() if t.grad_scaler is not None else None}


def load_trainer_state(t, state: dict) -> None:
    t.sampler.load_state_dict(state["sampler"])
    t.optimizer.num_steps = int(state.get("lr_schedule", {}).get("completed_updates", state["optimizer_steps"]))
    t.num_skipped = int(state.get("num_skipped", 0))
    if t.grad_scaler is not None and state.get("grad_scaler"):
        t.grad_scaler.load_state_dict(state["grad_scaler"])
