"""Where each rank's tensors sit in the logical (full, unsharded) tensors of the model.

A checkpoint stores tensors by logical name with the box (offsets and lengths per dim) each
piece holds, as Megatron's distributed checkpoints (``ShardedTensor``: key, global offset) and
``torch.distributed.checkpoint`` (chunk offsets and sizes) do, so any layout can read any
other's. Logical shapes never depend on the layout:

* vocab tables (``embedding.weight``, ``output.weight``) are ``[vocab_size, hidden]``: the rows
  a rank adds to pad the vocabulary to a multiple of tp are zeros and are not stored;
* ``mlp.gate_up.weight`` is ``[2, ffn, hidden]`` (gate, then up): a TP rank holds
  ``[gate_r; up_r]``, which is the box ``[0:2, r*ffn/tp : (r+1)*ffn/tp, :]`` of it;
* the fused QKV weight is already per query group (TP ranks hold whole groups), experts are
  ``[E, ffn, h]`` / ``[E, h, ffn]`` split over EP (dim 0) and ETP.

With these shapes every local parameter is ONE box of its logical tensor, and the box's
elements in row-major order are the first ``box.numel`` elements of the flat local parameter
(only trailing vocab padding follows). So a flat range of a local parameter, which is what a
distributed-optimizer rank holds of Adam's moments, is the same flat range of its box
(Megatron's ``flattened_range``), and is stored as such with no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from workers.parallel.fp8 import delayed_state

VOCAB_TABLES = ("embedding.weight", "output.weight")


@dataclass(frozen=True)
class Box:
    """A box of a tensor: ``offsets`` and ``lengths`` per dim."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def intersect(self, other: "Box") -> "Box | None":
        lo = [max(a, b) for a, b in zip(self.offsets, other.offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths)]
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(tuple(lo), tuple(h - l for l, h in zip(lo, hi)))

    def slices_in(self, outer: "Box") -> tuple[slice, ...]:
        """This box as index slices of a tensor holding ``outer``."""
        return tuple(slice(o - b, o - b + n) for o, n, b in zip(self.offsets, self.lengths, outer.offsets))


@dataclass(frozen=True)
class ParamView:
    """One local parameter as a box of its logical tensor.

    Attributes:
        name: the logical name (global layer index), e.g. ``layers.5.mlp.gate_up.weight``.
        shape: the logical tensor's shape.
        box: the part of it ``param`` holds.
        param: the local parameter.
    """

    name: str
    shape: tuple[int, ...]
    box: Box
    param: torch.nn.Parameter = field(compare=False, repr=False)

    def logical(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (param-shaped: the param, a moment) as a box-shaped view."""
        return local.reshape(-1)[: self.box.numel].view(self.box.lengths)

    @torch.no_grad()
    def assign(self, local: torch.Tensor, value: torch.Tensor) -> None:
        """Write box-shaped ``value`` into param-shaped ``local``; padding becomes 0."""
        flat = local.view(-1)
        flat[self.box.numel :].zero_()
        flat[: self.box.numel].copy_(value.reshape(-1).to(local.dtype))


def param_views(trainer) -> list[ParamView]:
    """Every local parameter of ``trainer`` as a :class:`ParamView`, in module order (the params'
    all-gather from the last update finished first: a checkpoint reads them, a load writes them)."""
    trainer.optimizer.finish_param_gather()
    vocab = trainer.job.model.vocab_size
    views = []
    for chunk in trainer.chunks:
        for name, p, shards in chunk.logical_parameters():
            shape, offsets = list(p.shape), [0] * p.dim()
            for dim, index, count in shards:
                offsets[dim] = index * shape[dim]
                shape[dim] *= count
            lengths = list(p.shape)
            if name.endswith("mlp.gate_up.weight"):
                # [gate_r; up_r] rows of [2 * ffn, h] -> box of [2, ffn, h]
                per = lengths[0] // 2
                shape, offsets, lengths = [2, shape[0] // 2, shape[1]], [0, offsets[0] // 2, 0], [2, per, lengths[1]]
            elif name in VOCAB_TABLES:
                shape[0] = vocab
                lengths[0] = max(0, min(offsets[0] + lengths[0], vocab) - offsets[0])
            views.append(ParamView(name, tuple(shape), Box(tuple(offsets), tuple(lengths)), p))
    return views


def buffer_views(trainer) -> list[ParamView]:
    """The model state kept beside the parameters (not trained by the optimizer, the same on
    every rank of a pipeline stage), as :class:`ParamView` s of whole tensors: each MoE router's
    expert bias, ``layers.i.mlp.router.expert_bias [E]`` float32 (aux-loss-free balancing), and
    each FP8 linear's delayed-scaling amax history and scales (``training.fp8_recipe: delayed``)."""
    views = []
    for chunk in trainer.chunks:
        for layer in chunk.all_layers():
            bias = getattr(getattr(layer.mlp, "router", None), "expert_bias", None)
            if bias is not None:
                name = f"{layer.prefix}.mlp.router.expert_bias"
                views.append(ParamView(name, tuple(bias.shape), Box((0,), tuple(bias.shape)), bias))
    for name, t in delayed_state(trainer.chunks):
        views.append(ParamView(name, tuple(t.shape), Box((0,) * t.dim(), tuple(t.shape)), t))
    return views


def fill(target: torch.Tensor, target_box: Box, piece_box: Box, data: torch.Tensor,
         flat: tuple[int, int] | None, covered: torch.Tensor) -> None:
    """Copy the part of a stored piece that overlaps ``target_box`` into ``target``.

    Args:
        target: ``target_box``-shaped output.
        piece_box: the box the piece belongs to.
        data: the piece's values: ``piece_box``-shaped, or 1-D when ``flat`` is given.
        flat: ``(begin, end)``: the piece is that flat range of ``piece_box`` (row-major).
        covered: bool, ``target``-shaped: marks the elements written (coverage check).
    """
    inter = target_box.intersect(piece_box)
    if inter is None:
        return
    if flat is None:
        t_idx, p_idx = inter.slices_in(target_box), inter.slices_in(piece_box)
        target[t_idx] = data.view(piece_box.lengths)[p_idx].to(target.dtype)
        covered[t_idx] = True
        return
    # A flat range is not a box: locate each element (O(piece) index arithmetic).
    begin, end = flat
    index = torch.arange(begin, end, dtype=torch.int64)
    inside = torch.ones_like(index, dtype=torch.bool)
    target_flat = torch.zeros_like(index)
    for dim in reversed(range(len(piece_box.lengths))):
        coord = index % piece_box.lengths[dim] + piece_box.offsets[dim]
        index = index // piece_box.lengths[dim]
        rel = coord - target_box.offsets[dim]
        inside &= (rel >= 0) & (rel < target_box.lengths[dim])
        target_flat += rel * math.prod(target_box.lengths[dim + 1 :])
    target.view(-1)[target_flat[inside]] = data[inside].to(target.dtype)
    covered.view(-1)[target_flat[inside]] = True
