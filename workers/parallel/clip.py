"""The global gradient norm and clipping by it (Megatron's ``clip_grad_norm_fp32``), any layout.

The norm is ``sqrt(sum of g^2)`` over every element of every logical parameter, each element
counted exactly once in the whole job, whatever the layout. After the data-parallel reduction
a rank holds, per param group (see :mod:`workers.parallel.data`):

* replicated optimizer: the full reduced grad, identical on every rank of the group's
  reduction group (dp-cp for dense params, tp-dp-cp for weights applied to sequence shards,
  expert-dp for experts): only the group's rank 0 counts it;
* distributed optimizer: its own 1/n slice of the reduced grad: every rank counts its slice.

What the reduction group does not cover is TP replication without sequence parallelism: a
norm weight (or a router) that every TP rank applies to the same full sequence has the same
complete grad on each TP rank, so only TP rank 0 counts it (Megatron's
``param_is_not_tensor_parallel_duplicate``). TP-sharded weights (distinct slices), expert
weights (sharded over EP/ETP, replicated only over expert-dp) and sequence-parallel weights
(reduced over TP already) are counted wherever their group rule says. Pipeline stages hold
disjoint layers (a tied embedding's last-stage copy is not counted). The per-rank sums of squares then add up
over the whole world in one all-reduce: every rank gets the same norm, in every layout.

Squares are summed in float64 from fp32 per-tensor norms, so the number a layout reports
differs from the single process only by the order of fp32 additions inside a tensor.
"""

from __future__ import annotations

from typing import Iterable

import torch

from workers.parallel import comm


def counted_on_this_tp_rank(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` enters the norm as far as TP is concerned.

    False only for a TP duplicate: a param that is neither TP-sharded, nor an expert, nor
    reduced over TP (sequence parallel), on a TP rank other than 0.
    """
    distinct = (getattr(param, "tensor_model_parallel", False) or getattr(param, "is_expert", False)
                or getattr(param, "sequence_parallel", False))
    return bool(distinct) or tp_rank == 0


def global_grad_norm_tensor(owned: Iterable[tuple[torch.Tensor, torch.Tensor]], *, tp_rank: int,
                             group) -> torch.Tensor:
    """The L2 norm of the whole job's gradient, left on the device (no host read).

    Args:
        owned: ``(param, grad piece)`` pairs this rank counts under its reduction-group rule
            (the optimizer's ``owned_grads()``); TP duplicates are filtered out here.
        tp_rank: this rank's TP rank.
        group: every rank of the job (``None``: a single process).

    Returns:
        A float64 ``[1]`` tensor on the grads' device, the same on every rank; ``inf``/``nan``
        if a grad is (the sum of squares is >= 0, so ``sqrt`` keeps them, as ``math.sqrt`` of
        the same float64 gives the same bits when finite).
    """
    # A tied embedding's copy on the last pipeline stage (tied_copy) is counted on the first.
    pieces = [g for p, g in owned if g.numel() and counted_on_this_tp_rank(p, tp_rank)
              and not getattr(p, "tied_copy", False)]
    device = pieces[0].device if pieces else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if pieces:
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in pieces]).double()
        total += norms.square().sum()
    comm.all_reduce(total, group)
    return total.sqrt_()


def global_grad_norm(owned: Iterable[tuple[torch.Tensor, torch.Tensor]], *, tp_rank: int, group) -> float:
    """:func:`global_grad_norm_tensor` read to the host (one sync): a Python float."""
    return float(global_grad_norm_tensor(owned, tp_rank=tp_rank, group=group).item())


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """Megatron's clip coefficient ``max_norm / (total_norm + 1e-6)``, capped at 1 (no clipping),
    computed on the device in float64 (the same IEEE operations as the host formula, so the
    same bits); ``nan`` for a ``nan`` norm, 0 for an infinite one."""
    # A tensor divided by a tensor: ``float / tensor`` would be ``reciprocal() * float``, one
    # more rounding than the host formula.
    return torch.clamp(torch.full_like(total_norm, max_norm) / (total_norm + 1.0e-6), max=1.0)


@torch.no_grad()
def clip_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (Megatron's
    ``clip_grad_by_total_norm_fp32``) without reading the norm on the host; returns the
    coefficient (a device tensor).

    As ``torch.nn.utils.clip_grad_norm_`` (foreach), the grads are always multiplied, by 1.0
    when no clipping is due: exact, so the result is bitwise that of scaling only below 1. The float64 coefficient is rounded to the grads' dtype first, as a Python float
    scalar would be. Every rank scales every grad it holds (replicas included) by the same
    value, so replicas stay bit-identical.
    """
    coeff = clip_coefficient(max_norm, total_norm)
    grads = list(grads)
    if grads:
        torch._foreach_mul_(grads, coeff.reshape(()).to(grads[0].device, grads[0].dtype))
    return coeff


@torch.no_grad()
def unscale_and_check(grads: Iterable[torch.Tensor], inv_scale: float, group) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; whether any rank found an inf or nan, as a
    float32 ``[1]`` device tensor, 1.0 or 0.0 (one MAX all-reduce over ``group``, so every rank
    takes the same skip decision). No host read: the optimizer skips the update on the device
    (``torch._fused_adamw_``'s ``found_inf``) and the trainer reads the flag with its metrics."""
    grads = list(grads)
    flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
    if grads:
        torch._foreach_mul_(grads, inv_scale)
        found = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
        flag += found.float()
    comm.all_reduce(flag, group, op=torch.distributed.ReduceOp.MAX)
    return flag
