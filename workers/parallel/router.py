"""The MoE router: Mixtral, Qwen3-MoE and DeepSeek-V3 top-k routing (Megatron-Core's
``TopKRouter`` and ``moe_utils.topk_routing_with_score_function``).

``logits = x W^T`` per token, then, by :class:`Routing`:

* ``softmax`` (Mixtral, Qwen3-MoE): the k largest logits pick the experts and a softmax over
  those k gives the gates (``pre_softmax: false``; Qwen3-MoE's ``norm_topk_prob: true``), or the
  softmax over all experts is taken first and the k chosen probabilities are the gates, not
  renormalised (``pre_softmax: true``; ``norm_topk_prob: false``).
* ``sigmoid`` (DeepSeek-V3): scores ``sigmoid(logits)``; the k chosen scores, divided by their
  sum, are the gates. With the expert bias (aux-loss-free balancing, DeepSeek-V3's
  ``e_score_correction_bias``) the choice ranks ``scores + bias`` but the gates are the
  unbiased scores.
* Group-limited routing (``num_groups``, ``group_topk``; DeepSeek-V3's ``n_group``,
  ``topk_group``): the experts form ``num_groups`` equal groups, each ranked by the sum of its
  ``topk // group_topk`` best scores; a token chooses its k experts among the best
  ``group_topk`` groups. (transformers ranks a group by its best 2 scores: the same for
  DeepSeek-V3's 8 / 4.)
* ``scaling_factor`` multiplies the gates (``routed_scaling_factor``).

The load-balancing loss follows Megatron's ``compute_routing_scores_for_aux_loss``: full
softmax (or sum-normalised sigmoid) scores, and the plain top-k of them as the routing map.
``aux_loss`` is the Switch loss of each microbatch; ``seq_aux_loss`` is that loss per sequence,
averaged over the microbatch's sequences (DeepSeek-V3's sequence-wise balance loss). Per-expert
counts are summed over :attr:`TopKRouter.token_group` (the ranks that share a microbatch's
tokens) first, so the loss and its gradient do not depend on the layout.

The expert bias is a float32 buffer, not a parameter. Each training forward adds its
choices to ``tokens_per_expert``; after each step :func:`update_expert_biases` sums those
counts over every rank that holds other tokens of the global batch (TP x DP x CP, which
includes EP) and moves every bias by ``rate * sign(mean load - load)`` (Megatron's
``get_updated_expert_bias``): every rank computes the same update from the same global
counts, so the bias is layout-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel import comm
from workers.parallel.initializer import materialize
from workers.parallel.recompute import is_recomputing
from workers.routing import Routing, routing_problem

__all__ = ["Routing", "TopKRouter", "group_limited_topk", "routers_with_bias", "update_expert_biases"]

def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Top-k of ``scores [T, E]`` among each token's ``group_topk`` best of ``num_groups``
    expert groups (Megatron's ``group_limited_topk``). Returns ``(values, indices)``."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


class TopKRouter(nn.Module):
    """Top-k router (see the module docstring) with its load-balancing loss and expert bias.

    Args:
        full_weight: ``[E, h]`` router weight (replicated, so the full tensor is kept).
        topk: experts per token, ``1 <= topk <= E``.
        aux_loss_coeff: weight of the load-balancing loss; 0 disables it.
        sequence_parallel: the caller's tokens are TP-sharded, so the weight's grad must also
            be all-reduced over TP (sets ``weight.sequence_parallel``).
        token_group: the ranks whose tokens together make one microbatch (TP x CP with SP,
            CP without; ``None``: this rank holds them all). The aux loss counts tokens per
            expert over this group.
        routing: score function, groups, scaling, bias and loss type (default: Mixtral's).

    Raises:
        ValueError: bad weight rank, topk out of range, negative coefficient, or routing
            fields that do not fit the experts.
    """

    def __init__(
        self, full_weight: torch.Tensor, topk: int, aux_loss_coeff: float = 0.0, *, sequence_parallel: bool = False,
        token_group=None, routing: Routing | None = None,
    ):
        super().__init__()
        if len(full_weight.shape) != 2:
            raise ValueError(f"router weight must be [num_experts, hidden], got shape {tuple(full_weight.shape)}")
        num_experts = full_weight.shape[0]
        if not 1 <= topk <= num_experts:
            raise ValueError(f"moe_router_topk ({topk}) must be between 1 and num_moe_experts ({num_experts})")
        if aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff ({aux_loss_coeff}) must be >= 0")
        self.routing = r = routing or Routing()
        problem = routing_problem(r, num_experts, topk)
        if problem:
            raise ValueError(problem)
        self.num_experts, self.topk, self.aux_loss_coeff = num_experts, topk, aux_loss_coeff
        self.token_group = token_group
        self.weight = nn.Parameter(materialize(full_weight).detach().clone().float())
        self.weight.sequence_parallel = sequence_parallel
        if r.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
            # int64: a cast of the module to bf16 leaves it alone (bf16 counts stop at 256).
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None

    def _apply(self, fn, *args, **kwargs):
        """Module casts (``.to(torch.bfloat16)``) and moves: the expert bias moves but stays float32,
        unrounded (as Megatron keeps it)."""
        bias = self.expert_bias
        out = super()._apply(fn, *args, **kwargs)
        if bias is not None:
            self._buffers["expert_bias"] = bias.to(device=self.weight.device, dtype=torch.float32)
        return out

    def forward(self, x: torch.Tensor, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route ``x [T, h]``, ``T = s * batch`` tokens in ``[s, batch]`` order.

        Returns:
            ``(gates [T, k], topk_idx [T, k] int64, aux_loss scalar)``.
        """
        logits = F.linear(x, self.weight)
        gates, topk_idx = self.route(logits)
        if self.expert_bias is not None and torch.is_grad_enabled() and not is_recomputing():
            # Training forwards only (not evaluation, not a recomputation): the bias update's loads.
            flat = topk_idx.reshape(-1)
            self.tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        return gates, topk_idx, self._aux_loss(logits, batch)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gates [T, k] in the logits' dtype, topk_idx [T, k])`` of ``logits [T, E]``."""
        r = self.routing
        if r.score_function == "softmax":
            if r.pre_softmax:
                gates, topk_idx = self._topk(torch.softmax(logits, dim=-1, dtype=torch.float32))
            else:
                top, topk_idx = self._topk(logits)
                gates = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            if self.expert_bias is not None:
                topk_idx = self._topk(scores + self.expert_bias)[1]
                gates = scores.gather(1, topk_idx)
            else:
                gates, topk_idx = self._topk(scores)
            if self.topk > 1:
                gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        if r.scaling_factor:
            gates = gates * r.scaling_factor
        return gates.type_as(logits), topk_idx

    def _topk(self, scores: torch.Tensor):
        r = self.routing
        if r.group_topk:
            return group_limited_topk(scores, self.topk, r.num_groups, r.group_topk)
        return torch.topk(scores, self.topk, dim=-1)

    def _aux_loss(self, logits: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's share of the load-balancing loss of the microbatch.

        The Switch loss of T tokens is ``coeff * E * sum_e f_e * P_e``, ``f_e`` the fraction of
        the T*k choices that went to expert e (no gradient) and ``P_e`` the mean score of e. As
        in Megatron (``switch_load_balancing_loss_func``), the counts behind ``f_e`` are summed
        over :attr:`token_group` first, and each rank keeps its own tokens' part of ``P_e``: the
        shares of the group's ranks add up to the loss of the whole microbatch, and each
        share's gradient is exactly that loss's gradient with respect to this rank's tokens.
        ``seq_aux_loss`` takes that loss per sequence (the group's ranks hold slices of the same
        ``batch`` sequences) and averages it over them.
        """
        kind = self.routing.load_balancing_type
        if self.aux_loss_coeff == 0 or kind == "none":
            return logits.new_zeros(())
        if self.routing.score_function == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        topk_idx = torch.topk(scores, self.topk, dim=-1).indices
        sequences = batch if kind == "seq_aux_loss" else 1
        # [T, E] scores and choices -> per (sequence, expert): token t is sequence t % batch.
        seq_of = torch.arange(logits.shape[0], device=logits.device) % sequences
        flat = (seq_of.unsqueeze(1) * self.num_experts + topk_idx).reshape(-1)
        # scatter_add, not bincount: no device-to-host sync to size the output.
        # fp32 whatever the compute dtype: bf16 counts stop being exact integers past 256.
        counts = torch.zeros(sequences * self.num_experts, dtype=torch.float32, device=logits.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        comm.all_reduce(counts, self.token_group)
        total_tokens = logits.shape[0] // sequences * comm.world_size(self.token_group)
        probs_sum = scores.view(-1, sequences * self.num_experts).sum(0)
        scale = self.num_experts * self.aux_loss_coeff / (self.topk * total_tokens * total_tokens * sequences)
        return (probs_sum * counts).sum() * scale

    @torch.no_grad()
    def apply_bias_update(self, global_counts: torch.Tensor) -> None:
        """``bias += rate * sign(mean load - load)`` from the global batch's counts; resets the count."""
        counts = global_counts.to(torch.float32)
        self.expert_bias.add_(torch.sign(counts.mean() - counts) * self.routing.bias_update_rate)
        self.tokens_per_expert.zero_()


def routers_with_bias(modules) -> list[TopKRouter]:
    """Every router with an expert bias in ``modules`` (e.g. a rank's model chunks), in order."""
    return [m for module in modules for m in module.modules()
            if isinstance(m, TopKRouter) and m.expert_bias is not None]


@torch.no_grad()
def update_expert_biases(modules, group) -> None:
    """After a step: sum every biased router's loads over ``group`` (the ranks holding the
    other tokens of the global batch: TP x DP x CP) in one all-reduce, then update each bias."""
    routers = routers_with_bias(modules)
    if not routers:
        return
    counts = torch.cat([r.tokens_per_expert for r in routers])
    comm.all_reduce(counts, group)
    for router, part in zip(routers, counts.split([r.num_experts for r in routers])):
        router.apply_bias_update(part)
