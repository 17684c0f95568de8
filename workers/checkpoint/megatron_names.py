"""Megatron-Core's ``torch_dist`` tensor keys of raytron's logical tensors, both ways, and the model
fields of a Megatron-LM ``args`` namespace.

A Megatron-Core distributed checkpoint stores each tensor under its ``ShardedTensor`` key, a
decoder layer's tensors stacked over the layers (a leading ``[num_layers]`` dim, global layer
numbers); the local and the Transformer-Engine layer specs share one set of keys (the local spec's
norms are mapped onto TE's fused names). raytron's logical tensors are the same numbers in the same
order but for that leading dim and ``linear_fc1``'s shape:

==========================================  ==================================================
raytron logical tensor                      Megatron-Core key (``L``: stacked over the layers)
==========================================  ==================================================
embedding.weight [V, h]                     embedding.word_embeddings.weight [V, h]
layers.i.input_norm.weight                  decoder.layers.self_attention.linear_qkv.layer_norm_weight  L
layers.i.attention.qkv.weight / .bias       decoder.layers.self_attention.linear_qkv.weight / .bias     L
  per query group: H/G q heads, k, v          the same interleaving
layers.i.attention.{q,k}_norm.weight        decoder.layers.self_attention.{q,k}_layernorm.weight        L
layers.i.attention.proj.weight              decoder.layers.self_attention.linear_proj.weight            L
layers.i.post_norm.weight                   decoder.layers.mlp.linear_fc1.layer_norm_weight             L
layers.i.mlp.gate_up.weight [2, F, h]       decoder.layers.mlp.linear_fc1.weight [L, 2F, h]: gate rows, then up
layers.i.mlp.down.weight                    decoder.layers.mlp.linear_fc2.weight                        L
MoE layer (import): post_norm.weight        decoder.layers.pre_mlp_layernorm.weight                     L
  mlp.router.weight [E, h], .expert_bias    decoder.layers.mlp.router.weight, .expert_bias              L
  mlp.experts.w_gate, w_up [E, F, h]        decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2F, h]
  mlp.experts.w_down [E, h, F]              decoder.layers.mlp.experts.experts.linear_fc2.weight [L, E, h, F]
  mlp.shared_mlp.gate_up / down             decoder.layers.mlp.shared_experts.linear_fc1 / fc2.weight   L
final_norm.weight                           decoder.final_layernorm.weight
output.weight                               output_layer.weight (absent when tied)
==========================================  ==================================================

The experts' keys are one for the sequential MLP and the grouped GEMM (megatron-core makes them
interchangeable); with ``singleton_local_shards`` each expert has its own key
(``decoder.layers.mlp.experts.experts.E.linear_fc1.weight``), read as the same ``[E, ...]`` tensor. Megatron's
vocabulary is the padded one (``padded_vocab_size``): raytron's ``vocab_size`` is it.
"""

from __future__ import annotations

# raytron's name within a layer -> Megatron-Core's within ``decoder.layers``
LAYER_KEYS = {
    "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "attention.qkv.weight": "self_attention.linear_qkv.weight",
    "attention.qkv.bias": "self_attention.linear_qkv.bias",
    "attention.q_norm.weight": "self_attention.q_layernorm.weight",
    "attention.k_norm.weight": "self_attention.k_layernorm.weight",
    "attention.proj.weight": "self_attention.linear_proj.weight",
    "post_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.gate_up.weight": "mlp.linear_fc1.weight",
    "mlp.down.weight": "mlp.linear_fc2.weight",
}
# an MoE layer's (import only): the norm before the MLP is a module of its own; the experts are stacked
# [L, E, ...] under one key whether Megatron ran them as a sequential MLP or a grouped GEMM
MOE_KEYS = {
    "post_norm.weight": "pre_mlp_layernorm.weight",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.expert_bias": "mlp.router.expert_bias",
    "mlp.experts.w_gate": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.w_up": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.w_down": "mlp.experts.experts.linear_fc2.weight",
    "mlp.shared_mlp.gate_up.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_mlp.down.weight": "mlp.shared_experts.linear_fc2.weight",
}
TOP_KEYS = {"embedding.weight": "embedding.word_embeddings.weight", "final_norm.weight": "decoder.final_layernorm.weight",
            "output.weight": "output_layer.weight"}
# the layer linears whose (empty) ``_extra_state`` Megatron-Core keeps beside the weight, one object a layer
EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def megatron_key(name: str) -> tuple[str, int | None]:
    """``(key, layer)`` of raytron logical tensor ``name`` of a dense model: the Megatron-Core key and,
    for a decoder layer's tensor, its index in the stacked leading dim (None for the others).

    Raises:
        ValueError: a tensor the format has no key for here (MoE experts, MLA, MTP).
    """
    if name in TOP_KEYS:
        return TOP_KEYS[name], None
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in LAYER_KEYS:
        return f"decoder.layers.{LAYER_KEYS[parts[2]]}", int(parts[1])
    raise ValueError(f"{name}: no Megatron-Core torch_dist key for this tensor (dense GPT/Llama models only: "
                     f"no MoE experts, MLA or MTP)")


def raytron_names(layers_of: dict[str, set[int]], num_layers: int) -> dict[str, tuple[str, int | None]]:
    """Every raytron logical tensor a checkpoint holds, with its ``(key, layer)``, given each stored key's
    layers (``layers_of``: the stacked dim's indices its chunks cover; any set for the others). The keys
    no raytron tensor comes from (optimizer state, RNG, extra state) are left out."""
    out = {name: (key, None) for name, key in TOP_KEYS.items() if key in layers_of}
    for i in range(num_layers):
        for table in (LAYER_KEYS, MOE_KEYS):  # an MoE layer's post_norm: pre_mlp_layernorm
            for rest, key in table.items():
                if i in layers_of.get(f"decoder.layers.{key}", ()):
                    out[f"layers.{i}.{rest}"] = (f"decoder.layers.{key}", i)
    return out


def stored_parts(name: str, box_offsets: tuple[int, ...], box_lengths: tuple[int, ...],
                 stored: tuple[int, ...]) -> list[tuple[int | None, tuple[int, ...]]]:
    """Where a box of raytron tensor ``name`` starts in one layer's stored tensor (shape ``stored``):
    ``[(j, offsets)]``, j the index along the box's dim 0 of a gate/up part read apart (``gate_up
    [2, F, h]`` is the rows ``[j * F + f]`` of ``[2F, h]``), None for the whole box. ``w_gate`` /
    ``w_up [E, F, h]`` are the first / second half of the rows of ``[E, 2F, h]``."""
    if name.endswith("gate_up.weight"):
        ffn = stored[0] // 2
        return [(j - box_offsets[0], (j * ffn + box_offsets[1], *box_offsets[2:]))
                for j in range(box_offsets[0], box_offsets[0] + box_lengths[0])]
    if name.endswith(("experts.w_gate", "experts.w_up")):
        ffn = stored[1] // 2 if name.endswith("w_up") else 0
        return [(None, (box_offsets[0], ffn + box_offsets[1], *box_offsets[2:]))]
    return [(None, box_offsets)]


# Megatron-LM argument -> raytron ModelConfig field, where only the name differs
ARG_FIELDS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
              "num_attention_heads": "num_attention_heads", "kv_channels": "kv_channels",
              "padded_vocab_size": "vocab_size", "rotary_base": "rotary_base", "norm_epsilon": "norm_epsilon",
              "add_qkv_bias": "add_qkv_bias", "qk_layernorm": "qk_layernorm",
              "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights"}
# what raytron's decoder is: a Megatron-LM argument with another value is a model raytron does not run
REQUIRED_ARGS = {"swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False, "position_embedding_type": "rope",
                 "rotary_interleaved": False, "rotary_percent": 1.0, "multi_latent_attention": False,
                 "mtp_num_layers": None}
MOE_ARGS = {"num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk",
            "moe_ffn_hidden_size": "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
            "moe_router_score_function": "moe_router_score_function", "moe_router_pre_softmax": "moe_router_pre_softmax",
            "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
            "moe_router_num_groups": "moe_router_num_groups", "moe_router_group_topk": "moe_router_group_topk",
            "moe_router_enable_expert_bias": "moe_router_enable_expert_bias"}


def model_from_args(args: dict) -> dict:
    """raytron ModelConfig fields of a Megatron-LM ``args`` namespace (as a dict).

    Raises:
        ValueError: an argument whose value raytron's decoder does not have, naming it.
    """
    bad = [f"{k}={args[k]!r} (raytron: {v!r})" for k, v in REQUIRED_ARGS.items()
           if k in args and args[k] != v and not (v is None and not args[k])]
    if bad:
        raise ValueError(f"a model raytron's decoder does not run: {', '.join(bad)}")
    out = {field: args[k] for k, field in ARG_FIELDS.items() if args.get(k) is not None}
    if args.get("num_experts"):
        out.update({field: args[k] for k, field in MOE_ARGS.items() if args.get(k) is not None})
        if isinstance(args.get("moe_layer_freq"), (int, list)):
            out["moe_layer_freq"] = args["moe_layer_freq"] if isinstance(args["moe_layer_freq"], int) else \
                tuple(args["moe_layer_freq"])
    if "num_attention_heads" in out:
        out["num_query_groups"] = (args.get("num_query_groups") if args.get("group_query_attention")
                                   else None) or out["num_attention_heads"]
    if out.get("kv_channels") and out.get("hidden_size") and out.get("num_attention_heads") and \
            out["kv_channels"] == out["hidden_size"] // out["num_attention_heads"]:
        out["kv_channels"] = None  # Megatron-LM fills in the default; raytron keeps it None
    return out


def args_from_model(m: dict, iteration: int) -> dict:
    """The Megatron-LM arguments of raytron model ``m`` that ``--use-checkpoint-args`` reads."""
    d = m.get("kv_channels") or m["hidden_size"] // m["num_attention_heads"]
    groups = m.get("num_query_groups") or m["num_attention_heads"]
    return {**{k: m.get(field) for k, field in ARG_FIELDS.items()}, **REQUIRED_ARGS,
            "kv_channels": d, "num_query_groups": groups, "group_query_attention": groups != m["num_attention_heads"],
            "seq_length": m["seq_length"], "max_position_embeddings": m["seq_length"],
            "use_rotary_position_embeddings": True, "add_position_embedding": False, "vocab_size": m["vocab_size"],
            "make_vocab_size_divisible_by": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "ckpt_format": "torch_dist", "iteration": iteration, "layernorm_epsilon": m.get("norm_epsilon")}
