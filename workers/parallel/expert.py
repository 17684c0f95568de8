"""Mixtral-style mixture of experts with expert parallelism (EP) and expert tensor parallelism
(ETP), dropless.

A :class:`MoELayer` takes the tokens this rank holds, ``x [s_local, b, h]`` (already split over
TP when sequence parallelism is on, and over CP), and returns ``(y [s_local, b, h], aux_loss)``.
Routing is per token and nothing is dropped, so each token's output depends on that token
alone: the result is the same for every layout, which is what the layout-invariance contract
needs.

* :class:`~workers.parallel.router.TopKRouter` (:mod:`workers.parallel.router`): picks each
  token's k experts and gates (Mixtral, Qwen3-MoE and DeepSeek-V3 routing) and computes the
  load-balancing loss. The router weight is replicated; its grad is complete once summed over
  every rank that holds different tokens, which the trainer does over dp-cp, plus over TP when
  the tokens are TP-sharded (``param.sequence_parallel``, as for norm weights).
* :class:`SwiGLUExperts`: ``y = W_down (silu(W_gate x) * W_up x)`` per expert, all local
  experts in one grouped GEMM per projection (:mod:`workers.parallel.grouped_gemm`). EP rank r owns
  experts ``[r*E/ep, (r+1)*E/ep)``; ETP rank j owns the j-th slice of every owned expert's ffn
  dim (gate/up rows, down columns), so its output is a partial sum that the dispatcher's
  reduce-scatter completes. Every expert parameter carries ``param.is_expert = True`` (the
  trainer reduces its grad over the expert-dp group, not dp-cp) plus ``ep_partition_dim`` and
  ``etp_partition_dim`` naming the dims split over EP and ETP (for checkpoints).
* :class:`~workers.parallel.moe_dispatch.AllToAllDispatcher` moves token choices between them.
* Optional shared experts (DeepSeek-V3, ``moe_shared_expert_intermediate_size``): a dense MLP,
  TP-sharded like the dense layers' MLP, that every token passes; its output is added.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.parallel import comm
from workers.parallel.grouped_gemm import ExpertRuns, swiglu_experts
from workers.parallel.initializer import materialize
from workers.parallel.moe_dispatch import AllToAllDispatcher
from workers.parallel.router import Routing, TopKRouter

__all__ = ["MoELayer", "Routing", "SwiGLUExperts", "TopKRouter"]


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
                f"the experts' ffn, moe_ffn_hidden_size or else ffn_hidden_size ({ffn}), is not divisible by "
                f"expert_tensor_parallel_size ({etp}); "
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
    """Router + dispatcher + experts (+ shared experts): ``x [s, b, h] -> (y [s, b, h], aux_loss)``.

    Args:
        router: picks each token's experts and gates.
        experts: this rank's expert shards.
        dispatcher: moves token choices over EP/ETP; its groups must be the experts'.
        shared: the shared experts, a module ``(x, residual=y) -> shared(x) + y`` on ``[s, b, h]``
            (``None``: none).

    Raises:
        ValueError: the three disagree on the number of experts.
    """

    def __init__(self, router: TopKRouter, experts: SwiGLUExperts, dispatcher: AllToAllDispatcher,
                 shared: nn.Module | None = None):
        super().__init__()
        if not router.num_experts == experts.num_experts == dispatcher.num_experts:
            raise ValueError(
                f"router ({router.num_experts}), experts ({experts.num_experts}) and dispatcher "
                f"({dispatcher.num_experts}) must agree on num_moe_experts"
            )
        if router.weight.shape[1] != experts.hidden_size:
            raise ValueError(f"router hidden ({router.weight.shape[1]}) != experts hidden ({experts.hidden_size})")
        self.router, self.experts, self.dispatcher = router, experts, dispatcher
        self.shared_mlp = shared

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
        routing: Routing | None = None,
        shared: nn.Module | None = None,
    ) -> "MoELayer":
        """Build every part from the full, unsharded tensors (see ``tests.helpers.init.init_full``).

        Args:
            router_weight: ``[E, h]``.
            w_gate, w_up: ``[E, ffn, h]``.
            w_down: ``[E, h, ffn]``.
            topk: experts per token (``moe_router_topk``).
            ep_group, etp_group: expert-parallel and expert-tensor-parallel groups.
            aux_loss_coeff: ``moe_aux_loss_coeff``.
            sequence_parallel: tokens are TP-sharded (marks the router weight).
            token_group: the ranks sharing a microbatch's tokens (see :class:`TopKRouter`).
            routing: the router's score function, groups, scaling, bias and loss type.
            shared: the shared experts (see the class).
        """
        router = TopKRouter(router_weight, topk, aux_loss_coeff, sequence_parallel=sequence_parallel,
                            token_group=token_group, routing=routing)
        experts = SwiGLUExperts(w_gate, w_up, w_down, ep_group, etp_group)
        return cls(router, experts, AllToAllDispatcher(router.num_experts, ep_group, etp_group), shared)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(y, aux_loss)``; ``y`` has ``x``'s shape, ``aux_loss`` is this rank's share."""
        if x.shape[-1] != self.experts.hidden_size:
            raise ValueError(f"MoE input hidden size {x.shape[-1]} != layer hidden size {self.experts.hidden_size}")
        flat = x.reshape(-1, x.shape[-1])
        gates, topk_idx, aux_loss = self.router(flat, x.shape[1] if x.dim() == 3 else 1)
        expert_input, runs, plan = self.dispatcher.dispatch(flat, topk_idx)
        expert_output = self.experts(expert_input, runs)
        y = self.dispatcher.combine(expert_output, gates, plan).view(x.shape)
        if self.shared_mlp is not None:
            y = self.shared_mlp(x, residual=y)
        return y, aux_loss
