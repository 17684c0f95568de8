"""DeepSeek-V3's attention and rotary keys of a Hugging Face ``config.json``: multi-latent
attention (:mod:`workers.model.mla`) and YaRN (:mod:`workers.model.yarn`), read into raytron's model fields
and written back. No torch here: the spec (``model: {from_hf: DIR}``) uses it too.

==============================  =============================================================
raytron model field             DeepseekV3Config
==============================  =============================================================
multi_latent_attention: true    (always)
q_lora_rank, kv_lora_rank       q_lora_rank (null: one q_proj), kv_lora_rank
qk_head_dim                     qk_nope_head_dim
qk_pos_emb_head_dim             qk_rope_head_dim (rope_interleave: true, the only layout)
v_head_dim                      v_head_dim
rotary_scaling_factor           rope_parameters / rope_scaling ``factor`` (rope_type yarn; 1 default)
mscale, mscale_all_dim          ``mscale`` (absent: 0 with mscale_all_dim, else 1), ``mscale_all_dim``
original_max_position_embeddings  ``original_max_position_embeddings`` (absent: max_position_embeddings)
beta_fast, beta_slow            ``beta_fast`` (absent: 32), ``beta_slow`` (absent: 1)
==============================  =============================================================

An absent ``mscale`` reads as 0 when ``mscale_all_dim`` is set because transformers then scales
cos and sin by ``mscale(factor, 1)``, which is what :func:`workers.model.yarn.rotary_attention_factor`
does with a zero ``mscale``. transformers' ``q_a_layernorm`` and ``kv_a_layernorm`` have eps 1e-6
whatever ``rms_norm_eps`` says, raytron's the one ``norm_epsilon``: both directions need 1e-6.
"""

from __future__ import annotations

MLA_KEYS = {"q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_nope_head_dim",
            "qk_pos_emb_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"}

PLAIN_ROPE = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
              "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
"""The YaRN fields of a model with plain RoPE: their defaults (workers.config.ModelConfig)."""


def rope_of(c: dict) -> dict:
    """The rope parameters of a config.json (transformers 5 ``rope_parameters`` or the older
    ``rope_scaling``), ``{}`` if neither."""
    return c.get("rope_parameters") or c.get("rope_scaling") or {}


def rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


LATENT_NORM_EPS = 1e-6
"""The epsilon of transformers' (and DeepSeek's own) q_a_layernorm and kv_a_layernorm, whatever
``rms_norm_eps`` is; raytron's MLA uses ``norm_epsilon`` for them as for every norm (Megatron)."""


def mla_refusal(c: dict) -> str:
    """Why raytron cannot run a DeepSeek-V3 config's attention ("" if it can)."""
    rope = rope_of(c)
    if c.get("rms_norm_eps", LATENT_NORM_EPS) != LATENT_NORM_EPS:
        return (f"rms_norm_eps {c['rms_norm_eps']:g} is not supported: DeepSeek-V3's q_a_layernorm and kv_a_layernorm "
                f"use {LATENT_NORM_EPS:g} whatever it says, raytron's MLA one norm_epsilon for every norm")
    if c.get("attention_bias"):
        return "attention_bias: true is not supported (raytron's MLA projections have no bias)"
    if c.get("rope_interleave", True) is False:
        return "rope_interleave: false is not supported (raytron's MLA rotates interleaved pairs, DeepSeek's layout)"
    if rope_type(rope) not in ("default", "yarn"):
        return f"rope scaling {rope_type(rope)!r} is not supported; raytron's MLA implements plain RoPE and yarn"
    if rope_type(rope) == "yarn":
        if rope.get("attention_factor") is not None:
            return "rope attention_factor is not supported; give mscale / mscale_all_dim (DeepSeek-V3's form)"
        if rope.get("truncate", True) is False:
            return "rope truncate: false is not supported (raytron rounds the YaRN ramp outwards, as DeepSeek-V3)"
    return ""


def mla_fields_from_hf(c: dict) -> dict:
    """The MLA and YaRN fields of the model section of a DeepSeek-V3 ``config.json`` (one
    key/value head per query head: ``num_query_groups`` = heads, no ``kv_channels``)."""
    out = {"multi_latent_attention": True, "num_query_groups": c["num_attention_heads"], "kv_channels": None,
           **{ours: c[theirs] for ours, theirs in MLA_KEYS.items()}}
    out.update(PLAIN_ROPE)
    rope = rope_of(c)
    if rope_type(rope) == "yarn":
        factor = rope.get("factor") or c["max_position_embeddings"] / rope["original_max_position_embeddings"]
        all_dim = float(rope.get("mscale_all_dim") or 0.0)
        mscale = rope.get("mscale")
        out.update({"rotary_scaling_factor": float(factor), "mscale_all_dim": all_dim,
                    "mscale": float(mscale) if mscale is not None else (0.0 if all_dim else 1.0),
                    "original_max_position_embeddings": int(rope.get("original_max_position_embeddings")
                                                            or c["max_position_embeddings"]),
                    "beta_fast": float(rope.get("beta_fast") or 32.0),
                    "beta_slow": float(rope.get("beta_slow") or 1.0)})
    return out


def hf_mla_config(m: dict) -> dict:
    """The attention and rope keys of the DeepSeek-V3 ``config.json`` of a raytron MLA model (a
    ModelConfig as a dict)."""
    theta = m["rotary_base"]
    rope = {"rope_type": "default", "rope_theta": theta}
    if m["rotary_scaling_factor"] > 1:
        rope = {"rope_type": "yarn", "type": "yarn", "rope_theta": theta, "factor": m["rotary_scaling_factor"],
                **{k: m[k] for k in ("mscale", "mscale_all_dim", "original_max_position_embeddings",
                                     "beta_fast", "beta_slow")}}
    heads = m["num_attention_heads"]
    return {**{theirs: m[ours] for ours, theirs in MLA_KEYS.items()}, "num_key_value_heads": heads,
            "head_dim": m["qk_pos_emb_head_dim"], "rope_interleave": True, "attention_bias": False,
            "rope_parameters": rope, "num_nextn_predict_layers": 0}
