"""Tensor parallelism (TP): Megatron-Core's column/row parallel linears and vocab-parallel
embedding, with optional sequence parallelism (SP); the vocab-parallel cross-entropy is in
:mod:`workers.parallel.cross_entropy`.

Activations are ``[seq, batch, hidden]``. A TP *region* is the stretch between a
:class:`ColumnParallelLinear` (weight rows, i.e. output features, split over the group) and
a :class:`RowParallelLinear` (weight columns, i.e. input features, split): inside it each
rank holds ``1/tp`` of the last dim, outside it every rank holds the whole hidden dim, either
replicated over the full sequence (SP off) or as its ``seq/tp`` slice (SP on, see
``sequence.py``). An MLP is ``column -> activation -> row``: one collective forward, one
backward.

Every layer is built from the *full* weight the caller initialised: a tensor, or a lazy one
(:mod:`workers.parallel.initializer`) of which only rank ``r``'s contiguous slice is ever
made, so every layout starts from the same model at O(shard) cost. The
slice is tagged ``tensor_model_parallel = True`` and ``partition_dim`` (0 or 1) for
checkpointing and gradient-norm code. ``group=None`` means no TP: the layers then match
``F.linear`` / ``F.embedding`` / ``F.cross_entropy`` and need no process group.

In fp32 training the linears' weight-gradient GEMMs accumulate straight into the
data-parallel gradient buffer (Megatron's gradient-accumulation fusion,
:mod:`workers.parallel.wgrad`), with or without TP; in every precision a zero-bubble
pipeline's ``B`` defers them to its ``W`` through the same module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel import comm, fp8_gemm
from workers.parallel.fp8 import quantize_grad, quantize_operands
from workers.parallel.initializer import materialize
from workers.parallel.sequence import reduce_scatter_to_sequence_parallel_region
from workers.parallel.wgrad import add_bias, grad_owner, linear, lookup, weight_grad

# ---------------------------------------------------------------------------------------
# Mappings (Megatron's mappings.py, the TP half; the SP half lives in sequence.py).
# ---------------------------------------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # all-reduce is in place; never write into autograd's buffer
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()  # x may be saved by its producer for backward: don't reduce in place
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _LinearWithSequenceGather(torch.autograd.Function):
    """``all_gather_seq(x) @ W.T`` that saves the sequence *shard* ``x`` for backward and
    gathers it again there (Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``
    with sequence parallelism): the gathered ``[s, b, in]`` input is never kept, so a
    column-parallel layer stores 1/tp of its input, at the price of one more all-gather.
    ``owned``: the weight gradient goes through :func:`workers.parallel.wgrad.weight_grad`
    (fused into ``weight.main_grad`` in fp32, deferred in a zero-bubble ``B``)."""

    @staticmethod
    def forward(ctx, x, weight, group, owned):
        ctx.group, ctx.owner, ctx.gemm = group, weight if owned else None, getattr(weight, "fp8_gemm", None)
        ctx.save_for_backward(x, weight)
        return fp8_gemm.forward(comm.all_gather(x, group, dim=0), weight, ctx.gemm)

    @staticmethod
    def backward(ctx, grad):
        # Megatron's async order: the input's all-gather runs under the input-gradient GEMM,
        # the input gradient's reduce-scatter under the weight-gradient GEMM.
        x, weight = ctx.saved_tensors
        full, gathering = comm.all_gather_start(x, ctx.group)
        grad_full_input = fp8_gemm.dgrad(grad, weight, ctx.gemm)
        comm.wait(gathering)
        grad_input, scattering = comm.reduce_scatter_start(grad_full_input, ctx.group)
        grad_weight = weight_grad(grad, full, ctx.owner, ctx.gemm)
        comm.wait(scattering)
        return grad_input, grad_weight, None, None


class _LinearWithAsyncAllReduce(torch.autograd.Function):
    """``x @ W.T`` entering a TP region without SP (:func:`copy_to_tensor_parallel_region`
    fused with the GEMM, Megatron's async all-reduce): backward starts the all-reduce of the
    input gradient and computes the weight gradient while it runs (``owned``: as
    :class:`_LinearWithSequenceGather`)."""

    @staticmethod
    def forward(ctx, x, weight, group, owned):
        ctx.group, ctx.owner, ctx.gemm = group, weight if owned else None, getattr(weight, "fp8_gemm", None)
        ctx.save_for_backward(x, weight)
        return fp8_gemm.forward(x, weight, ctx.gemm)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = fp8_gemm.dgrad(grad, weight, ctx.gemm)
        reducing = comm.all_reduce(grad_input, ctx.group, async_op=True)
        grad_weight = weight_grad(grad, x, ctx.owner, ctx.gemm)
        reducing.wait()
        return grad_input, grad_weight, None, None


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    n, r = comm.world_size(group), comm.rank(group)
    per = x.shape[-1] // n
    return x[..., r * per : (r + 1) * per].contiguous()


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region: forward identity, backward all-reduce of the partial gradients."""
    if comm.world_size(group) == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a TP region: forward all-reduce of the partial sums, backward identity."""
    if comm.world_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dim (``[..., h/tp] -> [..., h]``); backward takes this rank's slice."""
    if comm.world_size(group) == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, group)


# ---------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------


def _shard(full, dim: int, group, what: str, field: str) -> nn.Parameter:
    """This rank's contiguous slice of ``full`` (a tensor or a lazy block) along ``dim``, as a
    tagged parameter."""
    if len(full.shape) not in (1, 2):
        raise ValueError(f"{what}: expected a 2-D full weight (or 1-D bias), got shape {tuple(full.shape)}")
    n, r = comm.world_size(group), comm.rank(group)
    size = full.shape[dim]
    if size % n:
        raise ValueError(
            f"{what}: {field} {size} is not divisible by tensor_model_parallel_size {n}; "
            f"choose {field} as a multiple of {n} (or a smaller tensor_model_parallel_size)"
        )
    per = size // n
    param = nn.Parameter(materialize(full.narrow(dim, r * per, per)).detach().clone())
    param.tensor_model_parallel = True
    param.partition_dim = dim
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with W's rows (output features) and b split over the TP group.

    Args:
        full_weight: the unsharded ``[out, in]`` weight; rank r keeps rows
            ``[r*out/tp, (r+1)*out/tp)``.
        group: the tensor-parallel group (``None``: no TP).
        sequence_parallel: the input is this rank's ``[s/tp, b, in]`` sequence shard and is
            all-gathered along the sequence (backward gathers it again and reduce-scatters the
            input gradient; only the shard is saved); otherwise the input is the replicated
            ``[s, b, in]`` (backward all-reduces).
        gather_output: all-gather the output to ``[s, b, out]``; otherwise it stays
            ``[s, b, out/tp]``, ready for a RowParallelLinear or the vocab-parallel loss.
        full_bias: the unsharded ``[out]`` bias (split as the rows; each rank's output slice
            is complete, so its grad needs no TP reduction); ``None``: no bias.
    """

    fp8 = None  # a workers.parallel.fp8.LinearFp8 when this layer's GEMMs run in FP8

    def __init__(self, full_weight: torch.Tensor, group, *, sequence_parallel: bool = False,
                 gather_output: bool = False, full_bias=None):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        self.weight = _shard(full_weight, 0, group, "ColumnParallelLinear", "output size")
        self.bias = None if full_bias is None else _shard(full_bias, 0, group, "ColumnParallelLinear", "bias size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x, weight = quantize_operands(self, x, self.weight)  # FP8 (workers.parallel.fp8); else as given
        owned = grad_owner(weight) is not None
        if self.sequence_parallel and comm.world_size(self.group) > 1:
            y = _LinearWithSequenceGather.apply(x, weight, self.group, owned)
        elif comm.world_size(self.group) > 1:
            y = _LinearWithAsyncAllReduce.apply(x, weight, self.group, owned)
        else:
            y = linear(x, weight)
        y = quantize_grad(self, y, dtype, weight)
        if self.bias is not None:  # whatever the path above: the bias joins this rank's output slice
            y = add_bias(y, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.group)
        return y


class RowParallelLinear(nn.Module):
    """``y = x @ W.T`` with W's columns (input features) split over the TP group. No bias.

    Args:
        full_weight: the unsharded ``[out, in]`` weight; rank r keeps columns
            ``[r*in/tp, (r+1)*in/tp)``.
        group: the tensor-parallel group (``None``: no TP).
        sequence_parallel: reduce-scatter the partial outputs to this rank's
            ``[s/tp, b, out]`` sequence shard; otherwise all-reduce to ``[s, b, out]``.

    The input is always last-dim sharded, ``[s, b, in/tp]`` (Megatron's
    ``input_is_parallel=True``).
    """

    fp8 = None  # a workers.parallel.fp8.LinearFp8 when this layer's GEMMs run in FP8

    def __init__(self, full_weight: torch.Tensor, group, *, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = _shard(full_weight, 1, group, "RowParallelLinear", "input size")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T`` reduced over the group, plus ``residual`` (shaped as the output) if given."""
        if residual is not None and comm.world_size(self.group) == 1 and x.dtype == torch.float32 and not self.fp8:
            # No reduction between the GEMM and the residual add: one addmm does both. Not in
            # bf16/fp16: addmm rounds the sum once where a TP layout rounds the reduced GEMM and
            # then the sum, an asymmetry that flips MoE routing between layouts.
            return linear(x, self.weight, residual)
        dtype = x.dtype
        x, weight = quantize_operands(self, x, self.weight)  # FP8 (workers.parallel.fp8); else as given
        y = quantize_grad(self, linear(x, weight), dtype, weight)  # partial sum over this rank's input features
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)
        return y if residual is None else residual + y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the TP group.

    Args:
        full_weight: the unsharded ``[vocab, hidden]`` table; rank r keeps rows
            ``[r*vocab/tp, (r+1)*vocab/tp)``. The vocab must divide by tp (the model pads it).
        group: the tensor-parallel group (``None``: no TP).
        sequence_parallel: return this rank's ``[s/tp, b, hidden]`` sequence shard
            (reduce-scatter); otherwise the replicated ``[s, b, hidden]`` (all-reduce).

    ``forward(tokens)`` takes the full ``[s, b]`` long tokens on every TP rank. Each rank
    looks up the tokens in its range and writes zeros for the rest; the sum over the group
    is the full lookup.
    """

    def __init__(self, full_weight: torch.Tensor, group, *, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.weight = _shard(full_weight, 0, group, "VocabParallelEmbedding", "vocab size")
        per = self.weight.shape[0]
        self.vocab_start = comm.rank(group) * per
        self.vocab_end = self.vocab_start + per

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if comm.world_size(self.group) > 1:
            outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
            local = (tokens - self.vocab_start).masked_fill(outside, 0)
            out = lookup(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = lookup(tokens, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return reduce_from_tensor_parallel_region(out, self.group)
