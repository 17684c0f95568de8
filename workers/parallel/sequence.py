"""Sequence parallelism (SP): the sequence-dim mappings around tensor-parallel regions.

With SP on, the activations *outside* a tensor-parallel region (norms, residual adds,
dropout, routers) are split along the sequence: in Megatron's ``[seq, batch, hidden]``
layout, TP rank ``r`` of a group of ``tp`` holds rows ``[r*seq/tp, (r+1)*seq/tp)`` of dim 0.
A region is entered with an all-gather along the sequence (instead of TP's identity copy)
and left with a reduce-scatter along the sequence (instead of TP's all-reduce). An
all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes as
plain TP while storing 1/tp of those activations.

Weights used on sequence shards (RMSNorm weights, MoE routers) are replicated over the TP
group but each rank sees only its shard of the tokens, so their gradients are partial: mark
them with :func:`mark_sequence_parallel` and sum them with
:func:`allreduce_sequence_parallel_grads` after backward (Megatron does this in
``finalize_model_grads``). The trainer does not call it: it folds this sum into its gradient
reduction, reducing the marked weights over the tp x dp x cp group in the same pass as the
others over dp x cp (:func:`workers.train.reduce.param_groups`), one collective instead of two;
this function is the layers' own form of it, for code that uses the layers alone.

Every function accepts ``group=None`` (or a group of size 1) and is then the identity, so the
same model code runs as the single-process reference.
"""

from __future__ import annotations

from typing import Iterable

import torch

from workers.parallel import comm


def _check_seq(x: torch.Tensor, group, what: str) -> None:
    n = comm.world_size(group)
    if x.dim() == 0 or x.shape[0] % n:
        length = x.shape[0] if x.dim() else 0
        raise ValueError(
            f"{what}: sequence length {length} (dim 0) is not divisible by the tensor-parallel "
            f"size {n}; with sequence_parallel choose seq_length (per context-parallel rank) "
            f"as a multiple of tensor_model_parallel_size"
        )


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of dim 0."""
    n, r = comm.world_size(group), comm.rank(group)
    per = x.shape[0] // n
    return x[r * per : (r + 1) * per].contiguous()


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return comm.all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            # Each rank holds a partial gradient of the full sequence (its share of the
            # region's output columns): sum them and keep our slice.
            return comm.reduce_scatter(grad, ctx.group, dim=0), None, None
        # The consumer was replicated, so every rank's gradient is already complete.
        return _split_seq(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=0), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=0), None


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, *, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather sequence shards ``[s/tp, ...]`` into ``[s, ...]``.

    Args:
        x: this rank's sequence shard.
        group: the tensor-parallel group (``None``: identity).
        tensor_parallel_output_grad: True (the default, what a ColumnParallelLinear needs)
            when the gathered tensor feeds a tensor-parallel region, so each rank's gradient
            is partial and backward reduce-scatters; False when it feeds replicated compute,
            so backward just takes this rank's slice.
    """
    if comm.world_size(group) == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial ``[s, ...]`` over the group and keep this rank's ``[s/tp, ...]`` slice.

    Backward all-gathers the gradient along the sequence.
    """
    if comm.world_size(group) == 1:
        return x
    _check_seq(x, group, "reduce_scatter_to_sequence_parallel_region")
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Take this rank's ``[s/tp, ...]`` slice of a replicated ``[s, ...]`` tensor.

    Backward all-gathers the gradient along the sequence.
    """
    if comm.world_size(group) == 1:
        return x
    _check_seq(x, group, "scatter_to_sequence_parallel_region")
    return _ScatterToSequenceParallelRegion.apply(x, group)


def mark_sequence_parallel(param: torch.Tensor, sequence_parallel: bool = True) -> torch.Tensor:
    """Flag a TP-replicated weight that is applied to sequence shards; returns ``param``.

    Pass the job's ``sequence_parallel`` setting (as Megatron does): without SP every TP rank
    sees the whole sequence and its gradient is already complete.
    """
    param.sequence_parallel = bool(sequence_parallel)
    return param


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    # A data-parallel wrapper may accumulate into ``main_grad`` (Megatron's convention).
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], group) -> None:
    """Sum, over the TP group, the gradients of the params marked ``sequence_parallel``.

    Call after backward and before the data-parallel gradient reduction, on every rank of
    ``group`` with the same parameters in the same order. Unmarked params are skipped, so
    ``model.parameters()`` may be passed as is. Uses one flattened all-reduce per dtype.
    """
    if comm.world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        g = _grad_of(p) if getattr(p, "sequence_parallel", False) else None
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group)
        for g, synced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(synced.view_as(g))
