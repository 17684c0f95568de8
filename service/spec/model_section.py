"""The model section of a job spec (``ModelSpec``): the architecture fields, Megatron-Core's names, filled from ``from_hf``.

A strict pydantic model like the other sections (:mod:`service.spec.sections`); its rules live
beside the features they belong to (:mod:`service.spec.moe`, :mod:`service.spec.mla`,
:mod:`service.spec.from_hf`, :func:`service.spec.spec.spec_problems`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from service.spec.from_hf import hf_model_fields
from service.spec.sections import STRICT


class ModelSpec(BaseModel):
    model_config = STRICT
    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(64, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int | None = Field(None, ge=1, description="grouped-query attention; default = heads")
    ffn_hidden_size: int | None = Field(None, ge=1, description="default = 4 x hidden_size")
    vocab_size: int = Field(256, ge=2)
    seq_length: int = Field(64, ge=2)
    num_moe_experts: int | None = Field(None, ge=1, description="e.g. 4 -> Mixtral-style MoE layers")
    moe_router_topk: int = Field(2, ge=1)
    moe_aux_loss_coeff: float = Field(0.0, ge=0.0)
    rotary_base: float = Field(10000.0, gt=0, description="rotary embedding base (Llama 3: 500000)")
    norm_epsilon: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    recompute_granularity: Literal["full", "selective", "auto"] | None = Field(
        None, description="activation recomputation: full layers or the attention core; auto: chosen by the "
        "cost model (none or full, uniform, 1 layer)")
    recompute_method: Literal["uniform", "block"] | None = Field(None, description="with full: uniform | block")
    recompute_num_layers: int | None = Field(None, ge=1, description="with full: layers per group (uniform) or "
                                             "recomputed layers per pipeline chunk (block)")
    # -- MoE routing as DeepSeek-V3 and Qwen3-MoE route (rules: service/spec/moe.py) --
    moe_ffn_hidden_size: int | None = Field(None, ge=1, description="each routed expert's ffn size; default "
                                            "ffn_hidden_size (Qwen3-MoE: moe_intermediate_size)")
    moe_shared_expert_intermediate_size: int | None = Field(
        None, ge=1, description="shared experts' total ffn size (DeepSeek-V3: n_shared_experts x "
        "moe_intermediate_size), TP-sharded like the dense MLP; null = no shared experts")
    moe_router_score_function: Literal["softmax", "sigmoid"] = Field("softmax", description="sigmoid: DeepSeek-V3")
    moe_router_pre_softmax: bool = Field(False, description="softmax over all experts before the top-k, gates not "
                                         "renormalised (Qwen3-MoE norm_topk_prob: false); false: softmax over the k "
                                         "chosen logits (norm_topk_prob: true, Mixtral)")
    moe_router_topk_scaling_factor: float | None = Field(None, gt=0, description="multiplies the gates "
                                                         "(DeepSeek-V3 routed_scaling_factor)")
    moe_router_num_groups: int | None = Field(None, ge=1, description="group-limited routing: expert groups "
                                              "(DeepSeek-V3 n_group)")
    moe_router_group_topk: int | None = Field(None, ge=1, description="groups a token may use (topk_group)")
    moe_router_enable_expert_bias: bool = Field(False, description="aux-loss-free balancing: a per-expert bias "
                                                "for the top-k choice, updated from the global loads (sigmoid)")
    moe_router_bias_update_rate: float = Field(1e-3, gt=0, description="the bias step per iteration")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = Field(
        "aux_loss", description="the moe_aux_loss_coeff loss: per microbatch, per sequence, or none")
    moe_layer_freq: int | list[int] = Field(1, description="N: layers 0, N, 2N... are MoE; or one 1 (MoE) / "
                                            "0 (dense) per layer, e.g. DeepSeek's first_k_dense_replace 1: [0,1,1,...]")
    # Multi-latent attention (DeepSeek-V2/V3) and YaRN: rules in service/spec/mla.py, model in workers/model/mla.py.
    multi_latent_attention: bool = Field(False, description="DeepSeek-V2/V3 multi-latent attention (no GQA: "
                                         "leave num_query_groups unset)")
    q_lora_rank: int | None = Field(None, ge=1, description="MLA: query compression rank; null = no compression")
    kv_lora_rank: int = Field(512, ge=1, description="MLA: key/value latent rank")
    qk_head_dim: int = Field(128, ge=1, description="MLA: per-head q/k dim without position embedding "
                             "(HF qk_nope_head_dim)")
    qk_pos_emb_head_dim: int = Field(64, ge=2, description="MLA: rotary q/k dim; the rotary key is shared by "
                                     "all heads (HF qk_rope_head_dim)")
    v_head_dim: int = Field(128, ge=1, description="MLA: per-head value dim")
    rotary_scaling_factor: float = Field(1.0, ge=1.0, description="MLA: YaRN factor; 1 = plain RoPE")
    mscale: float = Field(1.0, ge=0.0, description="MLA YaRN: cos/sin temperature numerator")
    mscale_all_dim: float = Field(0.0, ge=0.0, description="MLA YaRN: temperature denominator and softmax scale")
    original_max_position_embeddings: int = Field(4096, ge=1, description="MLA YaRN: the pretraining context")
    beta_fast: float = Field(32.0, gt=0, description="MLA YaRN: rotations where the ramp starts (extrapolation)")
    beta_slow: float = Field(1.0, gt=0, description="MLA YaRN: rotations where the ramp ends (interpolation)")
    # Attention variants (Qwen2 / Qwen3)
    add_qkv_bias: bool = Field(False, description="bias on the QKV projection (Qwen2)")
    qk_layernorm: bool = Field(False, description="RMSNorm on each head's q and k before RoPE (Qwen3)")
    kv_channels: int | None = Field(None, ge=2, description="head dimension; default hidden_size / "
                                    "num_attention_heads (Qwen3: 128)")
    mtp_num_layers: int | None = Field(None, ge=1, description="multi-token prediction (DeepSeek-V3): D chained "
                                       "modules after the last layer, each predicting one token further; null = none")
    mtp_loss_scaling_factor: float = Field(0.1, ge=0.0, description="MTP: the objective adds factor / D x the sum "
                                           "of the D depths' losses (the reported loss stays the LM loss)")
    untie_embeddings_and_output_weights: bool = Field(True, description="false: the output layer shares the "
                                                      "embedding's weight (small Qwen models)")
    from_hf: str | None = Field(None, description="a Hugging Face model directory whose config.json fills every "
                                "architecture field (seq_length stays the spec's); a field also given must agree")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_hf(cls, data):
        """Every architecture field the spec leaves out, from ``from_hf``'s config.json (the spec's
        own values stay: :func:`from_hf_problems` names those that disagree)."""
        if isinstance(data, dict) and isinstance(data.get("from_hf"), str):
            try:
                return {**hf_model_fields(data["from_hf"]), **data}
            except ValueError:
                return data  # from_hf_problems reports it
        return data
