"""How an MoE router scores and picks (the ``moe_router_*`` model fields) and the rules those
fields obey: pure Python (no torch), so the spec's validation (:mod:`service.spec.moe`) and the
router (:mod:`workers.parallel.router`) share them."""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")


@dataclass(frozen=True)
class Routing:
    """How a :class:`~workers.parallel.router.TopKRouter` scores and picks (the ``moe_router_*`` fields)."""

    score_function: str = "softmax"
    pre_softmax: bool = False
    scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balancing_type: str = "aux_loss"

    @classmethod
    def of(cls, cfg) -> "Routing":
        """From a :class:`workers.config.ModelConfig`."""
        return cls(cfg.moe_router_score_function, cfg.moe_router_pre_softmax, cfg.moe_router_topk_scaling_factor,
                   cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_enable_expert_bias,
                   cfg.moe_router_bias_update_rate, cfg.moe_router_load_balancing_type)


def routing_problem(r: Routing, num_experts: int, topk: int) -> str:
    """What is wrong with ``r`` for ``num_experts`` and ``topk`` (empty: nothing), naming the fields."""
    if r.score_function not in SCORE_FUNCTIONS:
        return f"moe_router_score_function {r.score_function!r} must be one of {', '.join(SCORE_FUNCTIONS)}"
    if r.load_balancing_type not in LOAD_BALANCING_TYPES:
        return (f"moe_router_load_balancing_type {r.load_balancing_type!r} must be one of "
                f"{', '.join(LOAD_BALANCING_TYPES)}")
    if r.enable_expert_bias and r.score_function != "sigmoid":
        return ("moe_router_enable_expert_bias needs moe_router_score_function: sigmoid (as in Megatron-Core); "
                "set the score function or disable the bias")
    if r.pre_softmax and r.score_function != "softmax":
        return "moe_router_pre_softmax is for moe_router_score_function: softmax; unset it with sigmoid"
    if (r.num_groups is None) != (r.group_topk is None):
        return "moe_router_num_groups and moe_router_group_topk go together; give both or neither"
    if r.num_groups is not None:
        groups, pick = r.num_groups, r.group_topk
        if num_experts % groups:
            return (f"moe_router_num_groups {groups} does not divide num_moe_experts {num_experts}; "
                    f"use a divisor of {num_experts}")
        if pick > groups:
            return f"moe_router_group_topk {pick} > moe_router_num_groups {groups}; choose at most {groups} groups"
        if pick > topk:
            return (f"moe_router_group_topk {pick} > moe_router_topk {topk}: groups are ranked by their best "
                    f"topk // group_topk scores, which must be at least 1; lower group_topk")
        if topk > pick * (num_experts // groups):
            return (f"moe_router_topk {topk} > moe_router_group_topk {pick} x experts per group "
                    f"{num_experts // groups}: the chosen groups hold too few experts; raise group_topk")
    return ""
