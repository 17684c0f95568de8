"""The collectives every parallel layer uses, with per-group byte accounting.

All communication in raytron goes through these few functions so that (a) a group of size 1
(or ``None``: the single-process reference) costs nothing and needs no process group at all,
and (b) the benchmark can report the bytes each rank sent per group kind next to the analytic
minimum. Bytes are counted as a bandwidth-optimal (ring) implementation sends them:

=================  =====================================
all_reduce         2 (n-1)/n x tensor bytes
all_gather         (n-1)/n x output bytes
reduce_scatter     (n-1)/n x input bytes
all_to_all         bytes sent to the other ranks
send               tensor bytes
=================  =====================================

A group gets a readable label (``"tp"``, ``"dp-cp"``, ...) from ``workers.parallel.groups`` through
:func:`label_group`; unlabelled groups count under ``"other"``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist

_LABELS: dict[int, str] = {}
_BYTES: dict[str, float] = defaultdict(float)
_CALLS: dict[str, int] = defaultdict(int)


def label_group(group, label: str) -> None:
    """Name a group for the byte counters (done once, where groups are created)."""
    if group is not None:
        _LABELS[id(group)] = label


def group_label(group) -> str:
    return _LABELS.get(id(group), "other")


def reset_stats() -> None:
    _BYTES.clear()
    _CALLS.clear()


def stats() -> dict[str, dict[str, float]]:
    """Bytes sent and collective calls per group label since the last reset."""
    return {k: {"bytes": _BYTES[k], "calls": _CALLS[k]} for k in sorted(_BYTES)}


def _count(group, nbytes: float) -> None:
    label = group_label(group)
    _BYTES[label] += nbytes
    _CALLS[label] += 1


def world_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group, *, op=None, async_op: bool = False):
    """Reduce ``tensor`` in place over ``group`` (sum, or ``op`` such as
    ``dist.ReduceOp.MAX``). Returns a work handle when ``async_op``."""
    n = world_size(group)
    if n == 1:
        return None
    _count(group, 2 * (n - 1) / n * _nbytes(tensor))
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


def all_gather(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` in group-rank order."""
    n = world_size(group)
    if n == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _count(group, (n - 1) / n * _nbytes(out))
    dist.all_gather_single(out, tensor, group=group)
    return out.movedim(0, dim)


def all_gather_start(tensor: torch.Tensor, group):
    """Start concatenating every rank's ``tensor`` along dim 0; returns ``(out, work)``: ``out`` is
    valid once ``work.wait()`` returned (``work`` is None for a group of one). What runs between
    the two overlaps the collective (Megatron's async TP communication)."""
    n = world_size(group)
    if n == 1:
        return tensor, None
    tensor = tensor.contiguous()
    out = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _count(group, (n - 1) / n * _nbytes(out))
    return out, dist.all_gather_single(out, tensor, group=group, async_op=True)


def reduce_scatter_start(tensor: torch.Tensor, group):
    """Start summing ``tensor`` over ``group`` keeping this rank's 1/n slice of dim 0; returns
    ``(out, work)`` as :func:`all_gather_start`."""
    n = world_size(group)
    if n == 1:
        return tensor, None
    tensor = tensor.contiguous()
    if tensor.shape[0] % n:
        raise ValueError(f"reduce_scatter: dim size {tensor.shape[0]} not divisible by group size {n}")
    out = torch.empty((tensor.shape[0] // n,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _count(group, (n - 1) / n * _nbytes(tensor))
    return out, dist.reduce_scatter_single(out, tensor, group=group, async_op=True)


def wait(work) -> None:
    """Wait for a started collective (None: nothing was started)."""
    if work is not None:
        work.wait()


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group, *, async_op: bool = False):
    """All-gather flat ``shard`` into the preallocated flat ``out`` (n x shard)."""
    n = world_size(group)
    if n == 1:
        out.copy_(shard)
        return None
    _count(group, (n - 1) / n * _nbytes(out))
    return dist.all_gather_single(out, shard, group=group, async_op=async_op)


def reduce_scatter(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's 1/n slice of ``dim``."""
    n = world_size(group)
    if n == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    if tensor.shape[0] % n:
        raise ValueError(f"reduce_scatter: dim size {tensor.shape[0]} not divisible by group size {n}")
    out = torch.empty((tensor.shape[0] // n,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _count(group, (n - 1) / n * _nbytes(tensor))
    dist.reduce_scatter_single(out, tensor, group=group)
    return out.movedim(0, dim)


def reduce_scatter_into(out: torch.Tensor, flat: torch.Tensor, group, *, async_op: bool = False):
    """Reduce-scatter flat ``flat`` (n x shard) into the flat shard ``out``."""
    n = world_size(group)
    if n == 1:
        out.copy_(flat)
        return None
    _count(group, (n - 1) / n * _nbytes(flat))
    return dist.reduce_scatter_single(out, flat, group=group, async_op=async_op)


def all_to_all(
    tensor: torch.Tensor,
    group,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """All-to-all along dim 0 with (possibly uneven) splits, in group-rank order."""
    n = world_size(group)
    if n == 1:
        return tensor
    tensor = tensor.contiguous()
    row = tensor.element_size() * math.prod(tensor.shape[1:])
    if input_split_sizes is None:
        per = tensor.shape[0] // n
        input_split_sizes = [per] * n
    if output_split_sizes is None:
        output_split_sizes = list(input_split_sizes)
    me = rank(group)
    _count(group, row * (sum(input_split_sizes) - input_split_sizes[me]))
    out = torch.empty((sum(output_split_sizes),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_to_all_single(out, tensor, list(output_split_sizes), list(input_split_sizes), group=group)
    return out


def p2p(
    sends: Sequence[tuple[torch.Tensor, int] | tuple[torch.Tensor, int, int]],
    recvs: Sequence[tuple[torch.Tensor, int] | tuple[torch.Tensor, int, int]],
    group=None,
):
    """Batched point-to-point: items are (tensor, global peer rank[, tag]). Returns the works.

    raytron's own callers pass no tag: NCCL ignores tags and matches a pair's messages in
    posting order, so every caller keeps that order identical on both sides (the pipeline's
    is proven by :func:`workers.parallel.pipeline_p2p.simulate_nccl`).
    """
    ops = []
    for t, peer, *tag in sends:
        _count(group, _nbytes(t))
        ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, group=group, tag=tag[0] if tag else 0))
    for t, peer, *tag in recvs:
        ops.append(dist.P2POp(dist.irecv, t, peer, group=group, tag=tag[0] if tag else 0))
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def broadcast(tensor: torch.Tensor, src: int, group) -> None:
    """Broadcast from global rank ``src`` (counted as the tensor's bytes once per rank)."""
    if world_size(group) == 1:
        return
    _count(group, _nbytes(tensor) / world_size(group))
    dist.broadcast(tensor, src=src, group=group)
