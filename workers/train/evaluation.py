"""Evaluation on the held-out split (Megatron's ``evaluate``), layout-invariant.

After iteration ``k`` with ``k % eval_interval == 0`` (and once after the last iteration when
``train_iters`` is not a multiple, as Megatron's end-of-training evaluation), every rank runs
``eval_iters`` validation global batches forward-only through the pipeline: the same dp cut,
microbatches, CP split and loss scaling (``sum(token losses) / tokens_in_global_batch``) as
training, under ``torch.no_grad``. The validation loss is the mean over those batches of the
global-batch mean token loss, so every layout reports the same number. Evaluations continue
one validation stream (:meth:`workers.data.dataset.GlobalSampler.validation_batch`), so evaluation
``e`` reads the same samples whatever the layout or restart.
"""

from __future__ import annotations

import torch

from workers.data.dataset import eval_index


def due_evaluation(iteration: int, eval_interval: int | None, train_iters: int) -> int | None:
    """The 0-based evaluation number due after ``iteration`` completed iterations, or None."""
    index = eval_index(iteration, eval_interval)
    if index is None and eval_interval and iteration == train_iters:
        index = train_iters // eval_interval  # the end-of-training evaluation
    return index


def evaluate_if_due(trainer) -> float | None:
    """Run the evaluation due after ``trainer``'s current iteration; its loss, else None."""
    t = trainer.job.training
    index = due_evaluation(trainer.iteration, t.eval_interval, t.train_iters)
    if index is None or t.eval_iters <= 0:
        return None
    return evaluate(trainer, index)


@torch.no_grad()
def evaluate(trainer, index: int) -> float:
    """Validation loss of evaluation ``index`` (a collective: every rank calls it)."""
    t = trainer.job.training
    total = 0.0
    for k in range(t.eval_iters):
        def microbatch(mb: int, k=k):
            return trainer.local_slice(
                lambda start, count: trainer.sampler.validation_batch(index, k, t.eval_iters, start, count), mb)

        total += trainer.global_loss(trainer.run_microbatches(microbatch, forward_only=True))
    for chunk in trainer.chunks:
        chunk.pop_aux_loss()  # evaluation's MoE aux losses are not training's
    return total / t.eval_iters
