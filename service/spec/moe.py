"""The rules of the MoE routing fields of the model section (:class:`service.spec.model_section.ModelSpec`),
Megatron-Core's ``TransformerConfig`` checks, each naming the fields, the numbers and the fix. The
fields reach :class:`workers.config.ModelConfig` by name (:func:`service.spec.spec.to_job_config`)."""

from __future__ import annotations

from service.spec.model_section import ModelSpec
from workers.routing import Routing, routing_problem

ROUTING_FIELDS = ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_score_function",
                  "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
                  "moe_router_group_topk", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                  "moe_router_load_balancing_type", "moe_layer_freq")


def moe_problems(m: ModelSpec, tp: int, etp: int) -> list[str]:
    """Problems of the MoE routing fields (the expert count and parallel sizes are checked in
    :func:`service.spec.spec.spec_problems`)."""
    if not m.num_moe_experts:
        return [f"model.{name} is for MoE models; set model.num_moe_experts or drop it"
                for name in ROUTING_FIELDS if getattr(m, name) != ModelSpec.model_fields[name].default]
    out = []
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
    if f % etp:
        what = "model.moe_ffn_hidden_size" if m.moe_ffn_hidden_size else "model.ffn_hidden_size"
        out.append(f"{what} {f} (the experts' ffn) is not divisible by expert_tensor_parallel_size {etp}; "
                   f"use a multiple of {etp}")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        out.append(f"model.moe_shared_expert_intermediate_size {shared} is not divisible by "
                   f"tensor_model_parallel_size {tp}; use a multiple of {tp}")
    routing = Routing(m.moe_router_score_function, m.moe_router_pre_softmax, m.moe_router_topk_scaling_factor,
                      m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_enable_expert_bias,
                      m.moe_router_bias_update_rate, m.moe_router_load_balancing_type)
    problem = routing_problem(routing, m.num_moe_experts, m.moe_router_topk)
    if problem:
        out.append(f"model.{problem}")
    if m.moe_router_load_balancing_type == "none" and m.moe_aux_loss_coeff:
        out.append(f"model.moe_aux_loss_coeff {m.moe_aux_loss_coeff} has no loss to weight with "
                   f"moe_router_load_balancing_type: none; set it to 0 or pick aux_loss / seq_aux_loss")
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        if not 1 <= freq <= m.num_layers:
            out.append(f"model.moe_layer_freq {freq} must be between 1 and model.num_layers {m.num_layers} "
                       f"(every N-th layer is MoE)")
    elif len(freq) != m.num_layers or set(freq) - {0, 1} or 1 not in freq:
        out.append(f"model.moe_layer_freq {freq} must list model.num_layers {m.num_layers} values, each 1 (MoE) "
                   f"or 0 (dense), at least one 1; e.g. first-k-dense 1: [0{', 1' * (m.num_layers - 1)}]")
    return out
