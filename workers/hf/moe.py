"""The MoE parts of Hugging Face's Qwen3-MoE and DeepSeek-V3: config fields and tensor names.

For ``checkpoint.load: hf:DIR`` and ``raytron export --format hf`` of ``Qwen3MoeForCausalLM`` and
``DeepseekV3ForCausalLM`` (the attention and the rest of the model are :mod:`workers.hf.interop`'s):

=====================================  =========================================================
raytron (logical)                      transformers (``model.`` prefix, ``save_pretrained`` names)
=====================================  =========================================================
layers.i.mlp.router.weight [E, h]      layers.i.mlp.gate.weight
layers.i.mlp.router.expert_bias [E]    layers.i.mlp.gate.e_score_correction_bias (DeepSeek-V3)
layers.i.mlp.experts.w_gate [E, f, h]  layers.i.mlp.experts.e.gate_proj.weight, e = 0..E-1
layers.i.mlp.experts.w_up [E, f, h]    layers.i.mlp.experts.e.up_proj.weight
layers.i.mlp.experts.w_down [E, h, f]  layers.i.mlp.experts.e.down_proj.weight
layers.i.mlp.shared_mlp.gate_up.weight layers.i.mlp.shared_experts.{gate,up}_proj.weight
  [2, F_shared, h]                       (DeepSeek-V3; F_shared = n_shared_experts x moe_intermediate_size)
layers.i.mlp.shared_mlp.down.weight    layers.i.mlp.shared_experts.down_proj.weight
=====================================  =========================================================

(transformers 5 holds the experts fused in memory, ``experts.gate_up_proj [E, 2f, h]``, gate
rows first, and ``experts.down_proj [E, h, f]``; its checkpoints keep the per-expert names.)
The dense layers of an MoE model (``moe_layer_freq`` 0) are the Llama MLP's names.
"""

from __future__ import annotations

ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def moe_fields_from_hf(c: dict) -> dict:
    """The MoE fields of the model section (Megatron-Core names) of a Qwen3-MoE or DeepSeek-V3
    ``config.json``; ``moe_layer_freq`` as a list per layer.

    Raises:
        ValueError: another model type, or routing this model does not reproduce exactly.
    """
    layers, kind = c["num_hidden_layers"], c.get("model_type")
    if kind == "qwen3_moe":
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
        freq = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
        experts = c.get("num_experts") or c["num_local_experts"]  # transformers 5 writes num_local_experts
        out = {"num_moe_experts": experts, "moe_router_topk": c["num_experts_per_tok"],
               "moe_ffn_hidden_size": c["moe_intermediate_size"],
               # norm_topk_prob false: the softmax over all experts, top-k not renormalised
               "moe_router_pre_softmax": not c.get("norm_topk_prob", False)}
    elif kind == "deepseek_v3":
        experts, topk = c.get("n_routed_experts") or c["num_local_experts"], c["num_experts_per_tok"]
        groups, group_topk = c.get("n_group") or 1, c.get("topk_group") or 1
        if not c.get("norm_topk_prob", True):
            raise ValueError("DeepSeek-V3 with norm_topk_prob: false is not supported: Megatron's sigmoid router "
                             "normalises the top-k scores")
        if groups > 1 and topk // group_topk != 2:
            raise ValueError(f"DeepSeek-V3 with num_experts_per_tok {topk} // topk_group {group_topk} != 2: "
                             f"transformers ranks a group by its best 2 scores, Megatron by its best topk // topk_group")
        k = c.get("first_k_dense_replace", 3)
        freq = [int(i >= k) for i in range(layers)]
        shared = c.get("n_shared_experts") or 0
        out = {"num_moe_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": c["moe_intermediate_size"],
               "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
               "moe_router_topk_scaling_factor": c.get("routed_scaling_factor", 1.0),
               "moe_router_num_groups": groups if groups > 1 else None,
               "moe_router_group_topk": group_topk if groups > 1 else None,
               "moe_shared_expert_intermediate_size": shared * c["moe_intermediate_size"] or None}
    else:
        raise ValueError(f"model_type {kind!r} is not an MoE family raytron reads (qwen3_moe, deepseek_v3)")
    out["moe_layer_freq"] = freq
    return out


def hf_moe_config(m: dict) -> dict:
    """The MoE keys of the ``config.json`` of a raytron model dict (``dataclasses.asdict`` of a
    :class:`workers.config.ModelConfig`): DeepSeek-V3's for sigmoid routing, else Qwen3-MoE's,
    with ``model_type`` and ``architectures``.

    Raises:
        ValueError: a model neither family expresses (named by the field).
    """
    layers, f = m["num_layers"], m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]
    freq = m.get("moe_layer_freq", 1)
    freq = [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) else list(freq)
    shared = m.get("moe_shared_expert_intermediate_size")
    if m.get("moe_router_score_function", "softmax") == "sigmoid":
        k = freq.index(1)
        if freq != [0] * k + [1] * (layers - k):
            raise ValueError(f"moe_layer_freq {freq}: DeepSeek-V3 has its first k layers dense, then MoE "
                             f"(first_k_dense_replace)")
        if shared and shared % f:
            raise ValueError(f"moe_shared_expert_intermediate_size {shared} is not a multiple of the expert ffn {f}: "
                             f"DeepSeek-V3 counts shared experts (n_shared_experts)")
        kind = "deepseek_v3"
        out = {"n_routed_experts": m["num_moe_experts"], "num_experts_per_tok": m["moe_router_topk"],
               "moe_intermediate_size": f, "n_shared_experts": (shared or 0) // f,
               "routed_scaling_factor": m.get("moe_router_topk_scaling_factor") or 1.0,
               "n_group": m.get("moe_router_num_groups") or 1, "topk_group": m.get("moe_router_group_topk") or 1,
               "norm_topk_prob": True, "first_k_dense_replace": k}
    else:
        if shared:
            raise ValueError("moe_shared_expert_intermediate_size: Qwen3-MoE has no shared experts "
                             "(DeepSeek-V3's need moe_router_score_function: sigmoid)")
        kind = "qwen3_moe"
        out = {"num_experts": m["num_moe_experts"], "num_experts_per_tok": m["moe_router_topk"],
               "moe_intermediate_size": f, "norm_topk_prob": not m.get("moe_router_pre_softmax", False),
               "decoder_sparse_step": 1, "mlp_only_layers": [i for i, x in enumerate(freq) if not x]}
    return {"model_type": kind, "architectures": [ARCHITECTURES[kind]], **out}


def hf_moe_names(name: str, num_experts: int) -> list[str] | None:
    """The transformers tensors (``model.`` prefixed) that make raytron's logical MoE tensor
    ``name`` (stacked in order along a new dim 0 when more than one), or None if ``name`` is not
    an MoE tensor."""
    if ".mlp." not in name:
        return None
    layer, rest = name.split(".mlp.", 1)
    p = f"model.{layer}.mlp"
    fixed = {"router.weight": [f"{p}.gate.weight"],
             "router.expert_bias": [f"{p}.gate.e_score_correction_bias"],
             "shared_mlp.gate_up.weight": [f"{p}.shared_experts.gate_proj.weight",
                                           f"{p}.shared_experts.up_proj.weight"],
             "shared_mlp.down.weight": [f"{p}.shared_experts.down_proj.weight"]}
    if rest in fixed:
        return fixed[rest]
    proj = {"experts.w_gate": "gate_proj", "experts.w_up": "up_proj", "experts.w_down": "down_proj"}.get(rest)
    return None if proj is None else [f"{p}.experts.{e}.{proj}.weight" for e in range(num_experts)]
