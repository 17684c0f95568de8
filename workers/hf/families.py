"""The Hugging Face model families raytron reads and writes, one table entry per ``model_type``:
how a ``config.json`` becomes ModelConfig fields, and back.

=========  =====================  ===========================================================
model_type architecture           raytron model fields beyond the Llama decoder
=========  =====================  ===========================================================
llama      LlamaForCausalLM       (none)
mixtral    MixtralForCausalLM     num_moe_experts, moe_router_topk
qwen2      Qwen2ForCausalLM       add_qkv_bias: true (q/k/v biases, none on o_proj)
qwen3      Qwen3ForCausalLM       qk_layernorm: true (q_norm / k_norm over each head)
qwen3_moe  Qwen3MoeForCausalLM    qk_layernorm, the MoE fields of :func:`workers.hf.moe.moe_fields_from_hf`
deepseek_v3 DeepseekV3ForCausalLM the MoE fields (sigmoid, groups, expert bias, shared experts,
                                  first_k_dense_replace), MLA and YaRN (:mod:`workers.hf.mla`)
=========  =====================  ===========================================================

Every family carries ``head_dim`` (``kv_channels``) and ``tie_word_embeddings``
(``untie_embeddings_and_output_weights``). A family is one :class:`Family`: its architecture,
what it reads beyond the common fields, what it refuses and what it writes. No torch here: the
spec (``model: {from_hf: DIR}``) uses it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from workers.hf.mla import LATENT_NORM_EPS, hf_mla_config, mla_fields_from_hf, mla_refusal, rope_of, rope_type
from workers.hf.moe import hf_moe_config, moe_fields_from_hf


@dataclass(frozen=True)
class Family:
    architecture: str
    read: Callable[[dict], dict] = lambda c: {}
    """config.json -> the ModelConfig fields of this family beyond the common ones."""
    refuse: Callable[[dict], str] = lambda c: ""
    """config.json -> why raytron cannot run it ("" if it can)."""
    write: dict = field(default_factory=dict)
    """config.json keys this family always writes (beyond the common ones)."""
    scaled_rope: bool = False
    """Whether ``read`` takes the rope scaling (YaRN) itself; else only plain RoPE is read."""


def _no_bias(c: dict) -> str:
    if c.get("attention_bias") or c.get("mlp_bias"):
        return "attention_bias / mlp_bias (a bias on every attention projection, o_proj too) is not supported"
    return ""


def _no_sliding(c: dict) -> str:
    if c.get("use_sliding_window"):
        return "use_sliding_window: true is not supported (raytron attends over the whole causal sequence)"
    return ""


def _moe(c: dict) -> dict:
    return {"num_moe_experts": c["num_local_experts"], "moe_router_topk": c.get("num_experts_per_tok", 2)}


def _routed(c: dict) -> dict:
    """The MoE fields of a Qwen3-MoE / DeepSeek-V3 config; none if every layer is dense, and
    ``moe_layer_freq`` 1 if every layer is MoE (the field's default)."""
    out = moe_fields_from_hf(c)
    if not any(out["moe_layer_freq"]):
        return {}
    if all(out["moe_layer_freq"]):
        out["moe_layer_freq"] = 1
    return out


def _deepseek(c: dict) -> dict:
    return {**mla_fields_from_hf(c), **_routed(c)}


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", refuse=_no_bias, write={"attention_bias": False, "mlp_bias": False}),
    "mixtral": Family("MixtralForCausalLM", read=_moe, write={"output_router_logits": False, "sliding_window": None}),
    "qwen2": Family("Qwen2ForCausalLM", read=lambda c: {"add_qkv_bias": True}, refuse=_no_sliding,
                    write={"use_sliding_window": False, "sliding_window": None}),
    "qwen3": Family("Qwen3ForCausalLM", read=lambda c: {"qk_layernorm": True},
                    refuse=lambda c: _no_sliding(c) or _no_bias(c),
                    write={"attention_bias": False, "use_sliding_window": False, "sliding_window": None}),
    # -- the MoE families (issue 21): routing in workers/hf/moe.py, MLA and YaRN in workers/hf/mla.py
    "qwen3_moe": Family("Qwen3MoeForCausalLM", read=lambda c: {"qk_layernorm": True, **_routed(c)},
                        refuse=lambda c: _no_sliding(c) or _no_bias(c),
                        write={"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                               "output_router_logits": False}),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", read=_deepseek, refuse=mla_refusal, scaled_rope=True,
                          write={"output_router_logits": False}),
}


def model_from_hf_config(c: dict) -> dict:
    """The ModelConfig fields of a Hugging Face config.json (any family of :data:`FAMILIES`)."""
    kind = c.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"hf: model_type {kind!r} is not supported; raytron reads {', '.join(FAMILIES)} models")
    family = FAMILIES[kind]
    rope = rope_of(c)
    if rope_type(rope) != "default" and not family.scaled_rope:
        raise ValueError(f"hf: rope scaling {rope.get('rope_type') or rope.get('type')!r} is not supported; "
                         f"raytron implements plain rotary embeddings")
    problem = family.refuse(c)
    if problem:
        raise ValueError(f"hf: {kind}: {problem}")
    heads, h = c["num_attention_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or h // heads
    model = {"num_layers": c["num_hidden_layers"], "hidden_size": h, "num_attention_heads": heads,
             "num_query_groups": c.get("num_key_value_heads") or heads, "ffn_hidden_size": c["intermediate_size"],
             "vocab_size": c["vocab_size"], "seq_length": c.get("max_position_embeddings"), "num_moe_experts": None,
             "rotary_base": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
             "norm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
             "add_qkv_bias": False, "qk_layernorm": False, "multi_latent_attention": False,
             "kv_channels": None if head_dim * heads == h else head_dim,
             "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False)}
    model.update(family.read(c))
    return model


def family_of(m: dict) -> str:
    """The model_type a model (a ModelConfig as a dict) is exported as.

    Raises:
        ValueError: a model no family raytron writes expresses, naming the fields.
    """
    moe, bias, qk = bool(m.get("num_moe_experts")), m.get("add_qkv_bias", False), m.get("qk_layernorm", False)
    sigmoid = moe and m.get("moe_router_score_function", "softmax") == "sigmoid"
    if m.get("multi_latent_attention"):
        if m["norm_epsilon"] != LATENT_NORM_EPS:
            raise ValueError(f"hf export: norm_epsilon {m['norm_epsilon']:g}: DeepSeek-V3's q_a_layernorm and "
                             f"kv_a_layernorm use eps {LATENT_NORM_EPS:g} whatever rms_norm_eps says, raytron's "
                             f"norm_epsilon; export a model trained with norm_epsilon: {LATENT_NORM_EPS:g}")
        if moe and not sigmoid:
            raise ValueError("hf export: multi_latent_attention is DeepSeek-V3's, whose router is "
                             "moe_router_score_function: sigmoid; this model routes by softmax")
        groups, pick = m.get("moe_router_num_groups") or 1, m.get("moe_router_group_topk") or 1
        if moe and groups > 1 and m["moe_router_topk"] // pick != 2:
            raise ValueError(f"hf export: moe_router_topk {m['moe_router_topk']} // moe_router_group_topk {pick} "
                             f"!= 2: DeepSeek-V3 ranks a group by its best 2 scores, raytron by its best "
                             f"topk // group_topk")
        return "deepseek_v3"
    if sigmoid:
        raise ValueError("hf export: moe_router_score_function sigmoid is DeepSeek-V3's, whose attention is "
                         "multi_latent_attention; this model has grouped-query attention")
    if moe and bias:
        raise ValueError("hf export: an MoE model with add_qkv_bias has no Hugging Face family raytron writes "
                         "(Mixtral and Qwen3-MoE have no q/k/v bias)")
    if moe and qk:
        return "qwen3_moe"
    if moe:
        extra = _not_mixtral(m)
        if extra:
            raise ValueError(f"hf export: {', '.join(extra)}: Mixtral (an MoE model without qk_layernorm) routes "
                             f"every layer by a softmax over the top-k, with no shared experts; set "
                             f"qk_layernorm: true to export as Qwen3-MoE")
        return "mixtral"
    if bias and qk:
        raise ValueError("hf export: add_qkv_bias with qk_layernorm has no Hugging Face family (Qwen2 has the "
                         "bias, Qwen3 the norms); export a model with one of them")
    return "qwen2" if bias else "qwen3" if qk else "llama"


def _not_mixtral(m: dict) -> list[str]:
    """The routing fields of an MoE model (with their values) that Mixtral cannot express."""
    f = m.get("moe_ffn_hidden_size")
    freq = m.get("moe_layer_freq", 1)
    odd = {"moe_ffn_hidden_size": f is not None and f != m["ffn_hidden_size"],
           "moe_shared_expert_intermediate_size": bool(m.get("moe_shared_expert_intermediate_size")),
           "moe_router_pre_softmax": bool(m.get("moe_router_pre_softmax")),
           "moe_router_topk_scaling_factor": m.get("moe_router_topk_scaling_factor") not in (None, 1.0),
           "moe_router_num_groups": bool(m.get("moe_router_num_groups")),
           "moe_layer_freq": freq != 1 and (isinstance(freq, int) or not all(freq))}
    return [f"{k} {m.get(k)!r}" for k, on in odd.items() if on]


def hf_config(m: dict) -> dict:
    """config.json for a model (a ModelConfig as a dict)."""
    kind = family_of(m)
    h, heads = m["hidden_size"], m["num_attention_heads"]
    config = {
        "architectures": [FAMILIES[kind].architecture], "model_type": kind,
        "vocab_size": m["vocab_size"], "hidden_size": h, "intermediate_size": m["ffn_hidden_size"],
        "num_hidden_layers": m["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": m["num_query_groups"], "head_dim": m.get("kv_channels") or h // heads,
        "max_position_embeddings": m["seq_length"], "rms_norm_eps": m["norm_epsilon"],
        "rope_theta": m["rotary_base"], "rope_parameters": {"rope_type": "default", "rope_theta": m["rotary_base"]},
        "hidden_act": "silu", "tie_word_embeddings": not m.get("untie_embeddings_and_output_weights", True),
        "attention_dropout": 0.0, "initializer_range": m.get("init_method_std", 0.02),
        "torch_dtype": "float32", "dtype": "float32", **FAMILIES[kind].write,
    }
    if kind == "mixtral":
        config.update({"num_local_experts": m["num_moe_experts"], "num_experts_per_tok": m["moe_router_topk"],
                       "router_aux_loss_coef": m["moe_aux_loss_coeff"]})
    elif kind == "qwen3_moe":
        config.update(hf_moe_config(m))
    elif kind == "deepseek_v3":
        config.update({**hf_mla_config(m), "num_nextn_predict_layers": m.get("mtp_num_layers") or 0})
        if m.get("num_moe_experts"):
            config.update(hf_moe_config(m))
        else:  # a dense MLA model: every layer before first_k_dense_replace
            config.update({"n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
                           "n_shared_experts": 0, "moe_intermediate_size": m["ffn_hidden_size"],
                           "first_k_dense_replace": m["num_layers"]})
    return config


def read_hf_config(directory: str | Path, what: str) -> dict:
    """``DIR/config.json`` as a dict; a missing or unreadable file is a ValueError naming ``what``."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} does not exist; point it at a Hugging Face model directory "
                         f"(save_pretrained writes config.json)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: {path} is not a readable JSON config ({e})") from None
