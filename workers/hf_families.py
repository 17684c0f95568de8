"""The Hugging Face model families raytron reads and writes, one table entry per ``model_type``:
how a ``config.json`` becomes ModelConfig fields, and back.

=========  =====================  ===========================================================
model_type architecture           raytron model fields beyond the Llama decoder
=========  =====================  ===========================================================
llama      LlamaForCausalLM       (none)
mixtral    MixtralForCausalLM     num_moe_experts, moe_router_topk
qwen2      Qwen2ForCausalLM       add_qkv_bias: true (q/k/v biases, none on o_proj)
qwen3      Qwen3ForCausalLM       qk_layernorm: true (q_norm / k_norm over each head)
=========  =====================  ===========================================================

Every family carries ``head_dim`` (``kv_channels``) and ``tie_word_embeddings``
(``untie_embeddings_and_output_weights``). A new family (Qwen3-MoE, DeepSeek-V3) is one more
:class:`Family`: its architecture, what it reads beyond the common fields, what it refuses and
what it writes. No torch here: the spec (``model: {from_hf: DIR}``) uses it too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Family:
    architecture: str
    read: Callable[[dict], dict] = lambda c: {}
    """config.json -> the ModelConfig fields of this family beyond the common ones."""
    refuse: Callable[[dict], str] = lambda c: ""
    """config.json -> why raytron cannot run it ("" if it can)."""
    write: dict = field(default_factory=dict)
    """config.json keys this family always writes (beyond the common ones)."""


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


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", refuse=_no_bias, write={"attention_bias": False, "mlp_bias": False}),
    "mixtral": Family("MixtralForCausalLM", read=_moe, write={"output_router_logits": False, "sliding_window": None}),
    "qwen2": Family("Qwen2ForCausalLM", read=lambda c: {"add_qkv_bias": True}, refuse=_no_sliding,
                    write={"use_sliding_window": False, "sliding_window": None}),
    "qwen3": Family("Qwen3ForCausalLM", read=lambda c: {"qk_layernorm": True},
                    refuse=lambda c: _no_sliding(c) or _no_bias(c),
                    write={"attention_bias": False, "use_sliding_window": False, "sliding_window": None}),
}


def model_from_hf_config(c: dict) -> dict:
    """The ModelConfig fields of a Hugging Face config.json (any family of :data:`FAMILIES`)."""
    kind = c.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"hf: model_type {kind!r} is not supported; raytron reads {', '.join(FAMILIES)} models")
    family = FAMILIES[kind]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
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
             "add_qkv_bias": False, "qk_layernorm": False,
             "kv_channels": None if head_dim * heads == h else head_dim,
             "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False)}
    model.update(family.read(c))
    return model


def family_of(m: dict) -> str:
    """The model_type a model (a ModelConfig as a dict) is exported as."""
    moe, bias, qk = bool(m.get("num_moe_experts")), m.get("add_qkv_bias", False), m.get("qk_layernorm", False)
    if moe and (bias or qk):
        raise ValueError("hf export: an MoE model with add_qkv_bias or qk_layernorm has no Hugging Face family "
                         "raytron writes yet (Mixtral has neither)")
    if bias and qk:
        raise ValueError("hf export: add_qkv_bias with qk_layernorm has no Hugging Face family (Qwen2 has the "
                         "bias, Qwen3 the norms); export a model with one of them")
    return "mixtral" if moe else "qwen2" if bias else "qwen3" if qk else "llama"


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
