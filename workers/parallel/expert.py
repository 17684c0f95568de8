"""Mixtral-style mixture of experts with expert parallelism (EP) and expert tensor parallelism
(ETP), dropless.

A :class:`MoELayer` takes the tokens this rank holds, ``x [s_local, b, h]`` (already split over
TP when sequence parallelism is on, and over CP), and returns ``(y [s_local, b, h], aux_loss)``.
Routing is per token and nothing is dropped, so each token's output depends on that token
alone: the result is the same for every layout, which is what the layout-invariance contract
needs.

* :class:`TopKRouter`: ``logits = x W^T``; the k largest logits pick the experts and a softmax
  over those k gives the gates (Mixtral; Megatron's ``moe_router_pre_softmax=False``). The
  router weight is replicated; its grad is complete once summed over every rank that holds
  different tokens, which the trainer does over dp-cp, plus over TP when the tokens are
  TP-sharded (``param.sequence_parallel``, as for norm weights). The load-balancing loss is
  Megatron's: per-expert token counts are summed over the ranks that share a microbatch's
  tokens (TP x CP with SP) before the loss, so it does not depend on the layout.
* :class:`SwiGLUExperts`: ``y = W_down (silu(W_gate x) * W_up x)`` per expert, all local
  experts in one grouped GEMM per projection (:mod:`workers.parallel.grouped_gemm`). EP rank r owns
  experts ``[r*E/ep, (r+1)*E/ep)``; ETP rank j owns the j-th slice of every owned expert's ffn
  dim (gate/up rows, down columns), so its output is a partial sum that the dispatcher's
  reduce-scatter completes. Every expert parameter carries ``param.is_expert = True`` (the
  trainer reduces its grad over the expert-dp group, not dp-cp) plus ``ep_partition_dim`` and
  ``etp_partition_dim`` naming the dims split over EP and ETP (for checkpoints).
* :class:`~workers.parallel.moe_dispatch.AllToAllDispatcher` moves token choices between them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel import comm
from workers.parallel.grouped_gemm import ExpertRuns, swiglu_experts
from workers.parallel.initializer import materialize
from workers.parallel.moe_dispatch import AllToAllDispatcher


class TopKRouter(nn.Module):
    """Top-k router with softmax over the selected logits and an optional Switch aux loss.

    Args:
        full_weight: ``[E, h]`` router weight (replicated, so the full tensor is kept).
        topk: experts per token, ``1 <= topk <= E``.
        aux_loss_coeff: weight of the load-balancing loss; 0 disables it.
        sequence_parallel: the caller's tokens are TP-sharded, so the weight's grad must also
            be all-reduced over TP (sets ``weight.sequence_parallel``).
        token_group: the ranks whose tokens together make one microbatch (TP x CP with SP,
            CP without; ``None``: this rank holds them all). The aux loss counts tokens per
            expert over this group.

    Raises:
        ValueError: bad weight rank, topk out of range or negative coefficient.
    """

    def __init__(
        self, full_weight: torch.Tensor, topk: int, aux_loss_coeff: float = 0.0, *, sequence_parallel: bool = False,
        token_group=None,
    ):
        super().__init__()
        if len(full_weight.shape) != 2:
            raise ValueError(f"router weight must be [num_experts, hidden], got shape {tuple(full_weight.shape)}")
        num_experts = full_weight.shape[0]
        if not 1 <= topk <= num_experts:
            raise ValueError(f"moe_router_topk ({topk}) must be between 1 and num_moe_experts ({num_experts})")
        if aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff ({aux_loss_coeff}) must be >= 0")
        self.num_experts, self.topk, self.aux_loss_coeff = num_experts, topk, aux_loss_coeff
        self.token_group = token_group
        self.weight = nn.Parameter(materialize(full_weight).detach().clone().float())
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x [T, h]``.

        Returns:
            ``(gates [T, k], topk_idx [T, k] int64, aux_loss scalar)``; ``topk_idx`` is in
            descending-logit order (ties broken by ``torch.topk``, deterministically).
        """
        logits = F.linear(x, self.weight)
        top_logits, topk_idx = torch.topk(logits, self.topk, dim=-1)
        gates = torch.softmax(top_logits, dim=-1)
        return gates, topk_idx, self._aux_loss(logits, topk_idx)

    def _aux_loss(self, logits: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """This rank's share of the Switch load-balancing loss of the microbatch.

        The loss is ``coeff * E * sum_e f_e * P_e`` over the microbatch's T tokens, ``f_e`` the
        fraction of the T*k choices that went to expert e (no gradient) and ``P_e`` the mean
        full-softmax probability of e. As in Megatron (``switch_load_balancing_loss_func``),
        the counts behind ``f_e`` are summed over :attr:`token_group` first, and each rank
        keeps its own tokens' part of ``P_e``: the shares of the group's ranks add up to the
        loss of the whole microbatch, and each share's gradient is exactly that loss's
        gradient with respect to this rank's tokens.
        """
        if self.aux_loss_coeff == 0:
            return logits.new_zeros(())
        flat = topk_idx.reshape(-1)
        # scatter_add, not bincount: no device-to-host sync to size the output.
        # fp32 whatever the compute dtype: bf16 counts stop being exact integers past 256.
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=logits.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        comm.all_reduce(counts, self.token_group)
        total_tokens = logits.shape[0] * comm.world_size(self.token_group)
        probs_sum = torch.softmax(logits.float(), dim=-1).sum(0)
        scale = self.num_experts * self.aux_loss_coeff / (self.topk * total_tokens * total_tokens)
        return (probs_sum * counts).sum() * scale


class SwiGLUExperts(nn.Module):
    """This rank's share of E SwiGLU experts.

    Args:
        w_gate: ``[E, ffn, h]`` full gate projections.
        w_up: ``[E, ffn, h]`` full up projections.
        w_down: ``[E, h, ffn]`` full down projections.
        ep_group: expert-parallel group (``None``: size 1).
        etp_group: expert-tensor-parallel group (``None``: size 1).

    Raises:
        ValueError: inconsistent shapes, E not divisible by ep, or ffn not divisible by etp.
    """

    def __init__(self, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, ep_group=None, etp_group=None):
        super().__init__()
        if len(w_gate.shape) != 3 or tuple(w_up.shape) != tuple(w_gate.shape):
            raise ValueError(
                f"w_gate and w_up must both be [E, ffn, h]; got {tuple(w_gate.shape)} and {tuple(w_up.shape)}"
            )
        num_experts, ffn, hidden = w_gate.shape
        if tuple(w_down.shape) != (num_experts, hidden, ffn):
            raise ValueError(f"w_down must be [E, h, ffn] = {(num_experts, hidden, ffn)}, got {tuple(w_down.shape)}")
        ep, etp = comm.world_size(ep_group), comm.world_size(etp_group)
        if num_experts % ep:
            raise ValueError(
                f"num_moe_experts ({num_experts}) is not divisible by expert_model_parallel_size ({ep}); "
                f"use an EP size that divides {num_experts}"
            )
        if ffn % etp:
            raise ValueError(
                f"ffn_hidden_size ({ffn}) is not divisible by expert_tensor_parallel_size ({etp}); "
                f"use an ETP size that divides {ffn}"
            )
        self.num_experts, self.hidden_size = num_experts, hidden
        self.num_local_experts, ffn_local = num_experts // ep, ffn // etp
        e0 = comm.rank(ep_group) * self.num_local_experts
        f0 = comm.rank(etp_group) * ffn_local
        def mine(w, etp_dim: int):  # only this rank's block is made when ``w`` is lazy
            return materialize(w.narrow(0, e0, self.num_local_experts).narrow(etp_dim, f0, ffn_local))

        self.w_gate = self._param(mine(w_gate, 1), etp_dim=1)
        self.w_up = self._param(mine(w_up, 1), etp_dim=1)
        self.w_down = self._param(mine(w_down, 2), etp_dim=2)

    @staticmethod
    def _param(shard: torch.Tensor, etp_dim: int) -> nn.Parameter:
        p = nn.Parameter(shard.detach().clone().float().contiguous())
        p.is_expert = True
        p.ep_partition_dim = 0
        p.etp_partition_dim = etp_dim
        return p

    def forward(self, x: torch.Tensor, runs: ExpertRuns) -> torch.Tensor:
        """Apply local expert i to the i-th run of ``x [R, h]`` (run lengths in ``runs``).

        All local experts run together in one grouped GEMM per projection
        (:func:`~workers.parallel.grouped_gemm.swiglu_experts`), even experts with zero rows,
        so each expert weight gets a (zero) gradient and the trainer's grad reduction sees
        the same tensors on every rank.
        """
        return swiglu_experts(x, self.w_gate, self.w_up, self.w_down, runs)


class MoELayer(nn.Module):
    """Router + dispatcher + experts: ``x [s, b, h] -> (y [s, b, h], aux_loss)``.

    Args:
        router: picks each token's experts and gates.
        experts: this rank's expert shards.
        dispatcher: moves token choices over EP/ETP; its groups must be the experts'.

    Raises:
        ValueError: the three disagree on the number of experts.
    """

    def __init__(self, router: TopKRouter, experts: SwiGLUExperts, dispatcher: AllToAllDispatcher):
        super().__init__()
        if not router.num_experts == experts.num_experts == dispatcher.num_experts:
            raise ValueError(
                f"router ({router.num_experts}), experts ({experts.num_experts}) and dispatcher "
                f"({dispatcher.num_experts}) must agree on num_moe_experts"
            )
        if router.weight.shape[1] != experts.hidden_size:
            raise ValueError(f"router hidden ({router.weight.shape[1]}) != experts hidden ({experts.hidden_size})")
        self.router, self.experts, self.dispatcher = router, experts, dispatcher

    @classmethod
    def from_full(
        cls,
        router_weight: torch.Tensor,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
        *,
        topk: int,
        ep_group=None,
        etp_group=None,
        aux_loss_coeff: float = 0.0,
        sequence_parallel: bool = False,
        token_group=None,
    ) -> "MoELayer":
        """Build every part from the full, unsharded tensors (see ``workers.config.init_full``).

        Args:
            router_weight: ``[E, h]``.
            w_gate, w_up: ``[E, ffn, h]``.
            w_down: ``[E, h, ffn]``.
            topk: experts per token (``moe_router_topk``).
            ep_group, etp_group: expert-parallel and expert-tensor-parallel groups.
            aux_loss_coeff: ``moe_aux_loss_coeff``.
            sequence_parallel: tokens are TP-sharded (marks the router weight).
            token_group: the ranks sharing a microbatch's tokens (see :class:`TopKRouter`).
        """
        router = TopKRouter(router_weight, topk, aux_loss_coeff, sequence_parallel=sequence_parallel,
                            token_group=token_group)
        experts = SwiGLUExperts(w_gate, w_up, w_down, ep_group, etp_group)
        return cls(router, experts, AllToAllDispatcher(router.num_experts, ep_group, etp_group))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(y, aux_loss)``; ``y`` has ``x``'s shape, ``aux_loss`` is this rank's share."""
        if x.shape[-1] != self.experts.hidden_size:
            raise ValueError(f"MoE input hidden size {x.shape[-1]} != layer hidden size {self.experts.hidden_size}")
        flat = x.reshape(-1, x.shape[-1])
        gates, topk_idx, aux_loss = self.router(flat)
        expert_input, runs, plan = self.dispatcher.dispatch(flat, topk_idx)
        expert_output = self.experts(expert_input, runs)
        y = self.dispatcher.combine(expert_output, gates, plan)
        return y.view(x.shape), aux_loss
