"""All-to-all token dispatcher for dropless MoE over the expert-parallel (EP) and
expert-tensor-parallel (ETP) groups (Megatron-Core's ``MoEAlltoAllTokenDispatcher``).

The path of one token choice (a token replicated once per selected expert)::

    local tokens [T, h] --replicate x k, stable sort by expert-->  [T*k, h]  (grouped by EP rank)
        --all_to_all over EP (variable splits)-->   rows ordered (src EP rank, local expert)
        --all_gather over ETP (variable sizes)-->   rows ordered (ETP rank, src EP rank, local expert)
        --stable sort by local expert-->            expert input, one contiguous run per expert
    experts (each ETP rank computes its ffn slice; partial sums)
        --inverse of all of the above, with reduce_scatter over ETP summing the partial sums-->
    [T*k, h] in choice order --weighted by the gates, summed over k--> [T, h]

Per-expert counts travel first (an all_to_all over EP, then an all_gather over ETP), so
every rank knows every split size before the tokens move. Nothing is dropped or padded on
the EP path; an expert or a whole EP rank may receive zero tokens.

Every collective is an autograd function whose backward is its adjoint: all_to_all's is the
reverse all_to_all with the splits swapped, and the ETP all-gather and reduce-scatter are each
other's. The ETP collectives have per-rank sizes and are each one ``comm.all_to_all``: the
all-gather sends this rank's rows to every peer, the reduce-scatter sends each peer its run
and sums what arrives in rank order; neither moves padding, whatever the routing imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.parallel import comm
from workers.parallel.grouped_gemm import ExpertRuns


# --------------------------------------------------------------------------------------------
# Differentiable collectives with per-rank sizes
# --------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return comm.all_to_all(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_to_all(grad.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def _gather_var(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's rows (rank i holds ``sizes[i]``) in group-rank order.

    An all-to-all that sends this rank's rows to every peer: unlike a padded all-gather it
    moves no padding, whatever the routing imbalance.
    """
    n, mine = len(sizes), sizes[comm.rank(group)]
    if max(sizes) == 0:  # sizes agree on every rank, so all of them skip the collective together
        return x.new_zeros((0,) + tuple(x.shape[1:]))
    return comm.all_to_all(torch.cat([x] * n), group, sizes, [mine] * n)


def _scatter_var(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's run of rows (rank i gets ``sizes[i]``).

    An all-to-all of each peer's run, then a local sum (in rank order, so deterministic).
    """
    n, mine = len(sizes), sizes[comm.rank(group)]
    if max(sizes) == 0:
        return x.new_zeros((0,) + tuple(x.shape[1:]))
    parts = comm.all_to_all(x.contiguous(), group, [mine] * n, sizes)
    return parts.view((n, mine) + tuple(x.shape[1:])).sum(0)


class _GatherVar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_var(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_var(grad.contiguous(), ctx.group, ctx.sizes), None, None


class _ScatterVar(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _scatter_var(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_var(grad.contiguous(), ctx.group, ctx.sizes), None, None


def all_to_all_var(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Differentiable ``comm.all_to_all`` with variable splits (identity for a size-1 group)."""
    if comm.world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, output_splits, input_splits)


def all_gather_var(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Differentiable all-gather along dim 0 where rank i holds ``sizes[i]`` rows."""
    if comm.world_size(group) == 1:
        return x
    return _GatherVar.apply(x, group, sizes)


def reduce_scatter_var(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Differentiable reduce-scatter along dim 0 where rank i keeps ``sizes[i]`` rows."""
    if comm.world_size(group) == 1:
        return x
    return _ScatterVar.apply(x, group, sizes)


# --------------------------------------------------------------------------------------------
# The dispatcher
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchPlan:
    """What :meth:`AllToAllDispatcher.combine` needs to undo one dispatch.

    Attributes:
        sort_idx: ``[T*k]`` choice index (token * k + slot) of each locally sorted row.
        input_splits: rows this rank sends to each EP rank.
        output_splits: rows this rank receives from each EP rank.
        etp_sizes: rows each ETP rank received from its EP all_to_all.
        expert_sort_idx: ``[R]`` gathered row of each expert-ordered row; ``None`` when the
            gathered rows are in expert order already (EP and ETP size 1).
        num_tokens: T, the local token count.
    """

    sort_idx: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    etp_sizes: list[int]
    expert_sort_idx: torch.Tensor | None
    num_tokens: int


class AllToAllDispatcher:
    """Moves token choices to the ranks that own their experts, and back.

    Args:
        num_experts: E, experts in the layer (over all EP ranks).
        ep_group: expert-parallel group (``None``: size 1). EP rank r owns experts
            ``[r*E/ep, (r+1)*E/ep)``.
        etp_group: expert-tensor-parallel group (``None``: size 1). Its ranks share the same
            experts, each holding a slice of every expert's ffn dim.

    Raises:
        ValueError: E not divisible by the EP size.
    """

    def __init__(self, num_experts: int, ep_group=None, etp_group=None):
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_size, self.etp_size = comm.world_size(ep_group), comm.world_size(etp_group)
        if num_experts < 1 or num_experts % self.ep_size:
            raise ValueError(
                f"num_moe_experts ({num_experts}) must be a positive multiple of "
                f"expert_model_parallel_size ({self.ep_size}); change one of them"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor):
        """Send each token choice to its expert's ranks.

        Args:
            x: ``[T, h]`` local tokens.
            topk_idx: ``[T, k]`` global expert index of each token's choices.

        Returns:
            ``(expert_input [R, h], runs, plan)``: the rows every local expert processes, one
            contiguous run per local expert in order (identical on all ranks of the ETP
            group), the run lengths (:class:`ExpertRuns`), and the plan for :meth:`combine`.
        """
        num_tokens, k = topk_idx.shape
        assert x.shape[0] == num_tokens, (x.shape, topk_idx.shape)
        flat_idx = topk_idx.reshape(-1)
        # Stable sort: equal experts keep token order, so the layout is deterministic.
        sort_idx = torch.argsort(flat_idx, stable=True)
        permuted = x.index_select(0, torch.div(sort_idx, k, rounding_mode="floor"))

        # scatter_add, not bincount: no device-to-host sync to size the output.
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat_idx.device)
        counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx))
        # recv_counts[src_ep_rank, local_expert]: rows arriving from each EP rank per expert.
        recv_counts = comm.all_to_all(counts, self.ep_group).view(self.ep_size, self.num_local_experts)
        # all_counts[etp_rank * ep + src_ep_rank, local_expert]
        all_counts = comm.all_gather(recv_counts, self.etp_group)
        # The split sizes the collectives need as Python ints: one device-to-host copy for all
        # of them (the only host sync of the layer), not one per list.
        host = torch.cat([counts, all_counts.reshape(-1)]).tolist()
        local, rows = host[: self.num_experts], host[self.num_experts :]
        per_ep = self.num_local_experts
        input_splits = [sum(local[r * per_ep : (r + 1) * per_ep]) for r in range(self.ep_size)]
        row_sums = [sum(rows[i * per_ep : (i + 1) * per_ep]) for i in range(self.etp_size * self.ep_size)]
        etp_rank = comm.rank(self.etp_group)
        output_splits = row_sums[etp_rank * self.ep_size : (etp_rank + 1) * self.ep_size]
        etp_sizes = [sum(row_sums[j * self.ep_size : (j + 1) * self.ep_size]) for j in range(self.etp_size)]
        # Rows per local expert: host ints from that same copy, and the device tensor they
        # were copied from, so the experts need no copy either way.
        runs = ExpertRuns(
            [sum(rows[e::per_ep]) for e in range(per_ep)], all_counts.reshape(-1, per_ep).sum(0),
        )

        received = all_to_all_var(permuted, self.ep_group, output_splits, input_splits)
        gathered = all_gather_var(received, self.etp_group, etp_sizes)

        if all_counts.shape[0] == 1:
            # One source (no EP, no ETP): the first sort already grouped the rows by expert.
            expert_sort_idx, expert_input = None, gathered
        else:
            local_expert = torch.arange(per_ep, device=all_counts.device).repeat(all_counts.shape[0])
            row_expert = torch.repeat_interleave(local_expert, all_counts.reshape(-1), output_size=sum(rows))
            expert_sort_idx = torch.argsort(row_expert, stable=True)
            expert_input = gathered.index_select(0, expert_sort_idx)
        plan = DispatchPlan(sort_idx, input_splits, output_splits, etp_sizes, expert_sort_idx, num_tokens)
        return expert_input, runs, plan

    def combine(self, expert_output: torch.Tensor, gates: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Bring expert outputs home and mix each token's k outputs by its gates.

        Args:
            expert_output: ``[R, h]`` rows in :meth:`dispatch`'s expert order; with ETP, this
                rank's partial sum (its ffn slice's contribution).
            gates: ``[T, k]`` gate weight of each choice.
            plan: from the matching :meth:`dispatch`.

        Returns:
            ``[T, h]``: ``sum_j gates[t, j] * expert_{topk_idx[t, j]}(x[t])``.
        """
        gathered = expert_output if plan.expert_sort_idx is None else _unsort(expert_output, plan.expert_sort_idx)
        # The reduce-scatter also finishes the ETP row-parallel down projection (sums slices).
        received = reduce_scatter_var(gathered, self.etp_group, plan.etp_sizes)
        permuted = all_to_all_var(received, self.ep_group, plan.input_splits, plan.output_splits)
        per_choice = _unsort(permuted, plan.sort_idx).view(plan.num_tokens, gates.shape[1], permuted.shape[-1])
        return (per_choice * gates.unsqueeze(-1).to(per_choice.dtype)).sum(1)


def _unsort(rows: torch.Tensor, sort_idx: torch.Tensor) -> torch.Tensor:
    """Inverse of ``rows_sorted = rows.index_select(0, sort_idx)``.

    ``sort_idx`` is a permutation, so every row of the output is written: ``new_empty``
    spares the zero fill.
    """
    return rows.new_empty(rows.shape).index_copy(0, sort_idx, rows)
