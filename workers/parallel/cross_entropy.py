"""The vocab-parallel cross-entropy (Megatron's ``vocab_parallel_cross_entropy``): the logits'
vocab dim is split over the TP group (the output of a :class:`~workers.parallel.tensor.ColumnParallelLinear`
without ``gather_output``); the max and the sum of exponentials are all-reduced over the group,
so the loss equals ``F.cross_entropy`` on the gathered logits without gathering them.
``group=None`` means no TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.parallel import comm

def _all_reduce_max(t: torch.Tensor, group) -> None:
    comm.all_reduce(t, group, op=dist.ReduceOp.MAX)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Saves the logits as they came (bf16 stays bf16) and the per-token log-sum-exp; backward
    rebuilds the softmax from them. No fp32 ``[tokens, vocab]`` tensor outlives the forward
    (the old one kept an fp32 softmax, and the caller an fp32 copy of the logits: PERF_NOTES 7);
    the fp32 math happens in the one temporary the subtraction of the max makes."""

    @staticmethod
    def forward(ctx, logits, target, group):
        per = logits.shape[-1]
        start = comm.rank(group) * per
        tp = comm.world_size(group) > 1
        # Shift by the global max so exp never overflows; the loss does not depend on it.
        logits_max = logits.amax(dim=-1).float()
        if tp:
            _all_reduce_max(logits_max, group)
            outside = (target < start) | (target >= start + per)
            local_target = (target - start).masked_fill(outside, 0)
        else:
            outside, local_target = None, target
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()
        # logits - max promotes to fp32 in the subtraction itself: no separate fp32 copy.
        sum_exp = torch.sub(logits, logits_max.unsqueeze(-1)).exp_().sum(dim=-1)
        if tp:
            predicted = predicted.masked_fill(outside, 0.0)
            # One all-reduce for both per-token sums: exactly one rank holds each target logit.
            packed = torch.stack([predicted, sum_exp])
            comm.all_reduce(packed, group)
            predicted, sum_exp = packed[0], packed[1]
        lse = sum_exp.log_().add_(logits_max)
        ctx.save_for_backward(logits, lse, local_target, *(() if outside is None else (outside,)))
        return lse - predicted

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, local_target, *outside = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), on the local vocab shard only.
        grad_loss = grad_loss.unsqueeze(-1)
        grad = torch.sub(logits, lse.unsqueeze(-1)).exp_().mul_(grad_loss)
        hit = -grad_loss if not outside else (-grad_loss).masked_fill(outside[0].unsqueeze(-1), 0.0)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), hit.expand(local_target.unsqueeze(-1).shape).to(grad.dtype))
        return grad.to(logits.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token cross-entropy of vocab-sharded logits, without gathering them.

    Args:
        logits: ``[s, b, vocab/tp]``, this rank's contiguous vocab slice (rank r holds
            ``[r*vocab/tp, (r+1)*vocab/tp)``), e.g. a ColumnParallelLinear's output.
        target: ``[s, b]`` long token ids in ``[0, vocab)``, the same on every TP rank.
        group: the tensor-parallel group (``None``: equals ``F.cross_entropy(...,
            reduction="none")``).

    Returns:
        ``[s, b]`` fp32 loss per token, identical on every TP rank (no reduction), computed
        in fp32 whatever the logits' dtype (as Megatron's), without an fp32 copy of them.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
            f"{tuple(target.shape)} disagree; expected logits [s, b, vocab/tp] and target [s, b]"
        )
    return _VocabParallelCrossEntropy.apply(logits, target, group)
