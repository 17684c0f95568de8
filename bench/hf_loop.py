"""The reference of ``bench/step_bench.py``'s step figure: the loop a user writes with transformers.

:class:`HFLoop` trains transformers' ``LlamaForCausalLM`` holding a raytron trainer's config and
weights with ``torch.optim.AdamW`` on the trainer's own batches, LR schedule and clipping.
"""

from __future__ import annotations

import torch


def hf_model(trainer):
    """transformers' LlamaForCausalLM with raytron's config and weights (fp32, sdpa attention)."""
    from dataclasses import asdict

    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.checkpoint.layout import param_views
    from workers.hf.interop import hf_config, to_hf

    m = asdict(trainer.job.model)
    config = {k: v for k, v in hf_config(m).items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa"))
    state = {}
    for v in param_views(trainer):
        state.update(to_hf(v.name, v.logical(v.param.detach()).clone(), m))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"weights did not map: missing {missing}, unexpected {unexpected}")
    return model


class HFLoop:
    """The loop a user writes: LlamaForCausalLM, torch.optim.AdamW (its defaults, weight decay
    on 2-D params only), clip_grad_norm_, the same LR schedule, batches and loss."""

    def __init__(self, trainer):
        from workers.train.lr_schedule import LRSchedule

        t = trainer.job.training
        self.t, self.sampler, self.model = t, trainer.sampler, hf_model(trainer)
        params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() > 1]}, {"params": [p for p in params if p.dim() <= 1],
                                                               "weight_decay": 0.0}],
            lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
        self.schedule, self.iteration = LRSchedule.from_config(t), 0
        self.tokens = t.global_batch_size * trainer.job.model.seq_length

    def train_step(self) -> dict:
        t = self.t
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_for_update(self.iteration)
        self.optimizer.zero_grad()
        total = 0.0
        for start in range(0, t.global_batch_size, t.micro_batch_size):
            tokens, labels = self.sampler.batch(self.iteration, start, t.micro_batch_size)
            logits = self.model(input_ids=tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            loss = loss / self.tokens
            loss.backward()
            total += float(loss.detach())
        if t.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.clip_grad)
        self.optimizer.step()
        self.iteration += 1
        return {"loss": total}
