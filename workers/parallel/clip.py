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
disjoint layers (embedding and output are untied). The per-rank sums of squares then add up
over the whole world in one all-reduce: every rank gets the same norm, in every layout.

Squares are summed in float64 from fp32 per-tensor norms, so the number a layout reports
differs from the single process only by the order of fp32 additions inside a tensor.
"""

from __future__ import annotations

import math
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


def global_grad_norm(owned: Iterable[tuple[torch.Tensor, torch.Tensor]], *, tp_rank: int, group) -> float:
    """The L2 norm of the whole job's gradient.

    Args:
        owned: ``(param, grad piece)`` pairs this rank counts under its reduction-group rule
            (the optimizer's ``owned_grads()``); TP duplicates are filtered out here.
        tp_rank: this rank's TP rank.
        group: every rank of the job (``None``: a single process).

    Returns:
        The norm as a Python float, the same on every rank; ``inf``/``nan`` if a grad is.
    """
    pieces = [g for p, g in owned if g.numel() and counted_on_this_tp_rank(p, tp_rank)]
    device = pieces[0].device if pieces else torch.device("cpu")
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if pieces:
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in pieces]).double()
        total += norms.square().sum()
    comm.all_reduce(total, group)
    return math.sqrt(float(total.item())) if math.isfinite(float(total.item())) else float(total.item())


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """Megatron's clip coefficient ``max_norm / (total_norm + 1e-6)``, capped at 1 (no clipping)."""
    return min(1.0, max_norm / (total_norm + 1.0e-6))


@torch.no_grad()
def clip_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1
    (Megatron's ``clip_grad_by_total_norm_fp32``); returns the coefficient applied (1.0: none).

    Every rank scales every grad it holds (replicas included) by the same float, so replicas
    stay bit-identical.
    """
    coeff = clip_coefficient(max_norm, total_norm)
    if not coeff < 1.0:
        return 1.0
    for g in grads:
        g.mul_(coeff)
    return coeff


@torch.no_grad()
def unscale_and_check(grads: Iterable[torch.Tensor], inv_scale: float, group) -> bool:
    """Multiply ``grads`` by ``inv_scale`` in place; whether any rank found an inf or nan
    (one MAX all-reduce over ``group``, so every rank takes the same skip decision)."""
    found = None
    for g in grads:
        g.mul_(inv_scale)
        bad = (~torch.isfinite(g)).any()
        found = bad if found is None else found | bad
    flag = torch.zeros(1, dtype=torch.float32, device=found.device if found is not None else "cpu")
    if found is not None:
        flag += found.float()
    comm.all_reduce(flag, group, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)
