"""What a training iteration sums across ranks, for :class:`workers.train.trainer.Trainer`: which
params reduce over which group, the LM loss and the MoE load-balancing loss."""

from __future__ import annotations

import torch

from workers.parallel.groups import ProcessGroups
from workers.parallel import comm


def param_groups(chunks, pg: ProcessGroups) -> tuple[list, int | None]:
    """The data-parallel param groups ``[(params, group), ...]`` and the index of the tied
    embedding's (None without one).

    Dense params reduce over dp-cp; weights applied to sequence shards (norms, routers with SP)
    over tp-dp-cp, since their TP ranks saw different tokens; experts over expert-dp. A tied
    embedding split over stages is a buffer of its own, laid out alike on the first and last
    stage, so that its reduced grad (or dp shard of it) sums over the two.
    """
    dense, seq, expert = [], [], []
    tied = [prm for chunk in chunks for prm in chunk.tied_parameters()]
    for chunk in chunks:
        for prm in chunk.parameters():
            if any(prm is t for t in tied):
                continue
            if getattr(prm, "is_expert", False):
                expert.append(prm)
            elif getattr(prm, "sequence_parallel", False):
                seq.append(prm)
            else:
                dense.append(prm)
    groups = [(dense, pg.dp_cp_group), (seq, pg.tp_dp_cp_group), (expert, pg.expert_dp_group),
              (tied, pg.dp_cp_group)]
    groups = [(params, group) for params, group in groups if params]
    return groups, (len(groups) - 1 if tied else None)


def global_loss_tensor(mb_losses: list[torch.Tensor], *, last_stage: bool, pg: ProcessGroups,
                       device: torch.device) -> torch.Tensor:
    """The last stage's microbatch losses summed over dp-cp, then shared along the pipeline:
    a float64 ``[1]`` tensor left on the device (no host read)."""
    value = torch.stack(mb_losses).sum() if last_stage else torch.zeros((), device=device)
    value = value.reshape(1).to(torch.float64)
    if last_stage:
        comm.all_reduce(value, pg.dp_cp_group)
    comm.all_reduce(value, pg.pp_group)  # other stages hold 0
    return value


def global_aux_loss(chunks, *, microbatches: int, tp_replicas: int, world_size: int, device: torch.device) -> float:
    """The MoE load-balancing loss (summed over layers, averaged over the ``microbatches`` of
    the whole job), reported apart from the LM loss: every rank's shares, summed over the world.
    Without SP the TP ranks compute the same share (``tp_replicas`` = tp), counted once."""
    import torch.distributed as dist

    local = sum(chunk.pop_aux_loss() for chunk in chunks)
    value = torch.tensor([local / (microbatches * tp_replicas)], dtype=torch.float64, device=device)
    if world_size > 1:
        comm.all_reduce(value, dist.group.WORLD)
    return float(value.item())
