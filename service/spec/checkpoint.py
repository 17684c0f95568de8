"""The rules of the checkpoint section's retention and HF-copy fields, each naming the fields, the numbers
and the fix."""

from __future__ import annotations


def retention_problems(c, t) -> list[str]:
    """What ``checkpoint.keep_best`` / ``best_metric`` / ``save_hf`` get wrong, given the training section ``t``."""
    if c.save_hf and not c.save_interval:
        return ["checkpoint.save_hf needs checkpoint.save_interval (it copies the checkpoints the job saves)"]
    if not c.keep_best:
        return []
    if not c.save_interval:
        return [f"checkpoint.keep_best {c.keep_best} needs checkpoint.save_interval (nothing is saved without it)"]
    if c.best_metric == "val_loss" and (not t.eval_interval or c.save_interval % t.eval_interval):
        return [f"checkpoint.keep_best ranks by val_loss, which a checkpoint has only when an evaluation runs at its "
                f"iteration: training.eval_interval {t.eval_interval} must divide checkpoint.save_interval "
                f"{c.save_interval}; set eval_interval to a divisor of it, or best_metric: lm_loss"]
    return []
