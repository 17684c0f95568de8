"""The spec side of multi-latent attention (MLA, :mod:`workers.model.mla`): its rules and its sizes for ``raytron plan`` (parameters, FLOPs, activations, CP bytes). Pure,
no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
YARN_FIELDS = ("rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
               "beta_fast", "beta_slow")


def mla_problems(m) -> list[str]:
    """Megatron-Core's MLA rules, each naming the field and the fix. A field that only MLA reads must
    keep its default on other models (compared by value: a dumped and re-read spec sets every field)."""
    defaults = type(m).model_fields
    changed = [f for f in MLA_FIELDS + YARN_FIELDS if getattr(m, f) != defaults[f].default]
    if not m.multi_latent_attention:
        return [f"model.{f} {getattr(m, f)} is for multi-latent attention; set model.multi_latent_attention: true "
                f"or drop model.{f}" for f in changed]
    out = []
    heads = m.num_attention_heads
    if m.num_query_groups is not None and m.num_query_groups != heads:
        out.append(f"model.num_query_groups {m.num_query_groups} is for grouped-query attention; "
                   f"multi_latent_attention has one key/value head per query head (num_attention_heads {heads}): "
                   f"drop model.num_query_groups")
    out += [f"model.{f} is for grouped-query attention (Qwen2/Qwen3); multi_latent_attention has its own "
            f"projections and head dims (qk_head_dim, qk_pos_emb_head_dim, v_head_dim): drop model.{f}"
            for f, on in (("add_qkv_bias", getattr(m, "add_qkv_bias", False)),
                          ("qk_layernorm", getattr(m, "qk_layernorm", False)),
                          ("kv_channels", getattr(m, "kv_channels", None) is not None)) if on]
    if m.qk_pos_emb_head_dim % 2:
        out.append(f"model.qk_pos_emb_head_dim {m.qk_pos_emb_head_dim} must be even: rotary embeddings rotate "
                   f"pairs of dims; use e.g. {m.qk_pos_emb_head_dim + 1}")
    if m.rotary_scaling_factor == 1:
        out += [f"model.{f} {getattr(m, f)} has no effect without YaRN; set model.rotary_scaling_factor above 1 "
                f"(DeepSeek-V3: 40) or drop model.{f}" for f in changed if f in YARN_FIELDS]
    elif m.beta_fast <= m.beta_slow:
        out.append(f"model.beta_fast {m.beta_fast:g} must be above model.beta_slow {m.beta_slow:g} (YaRN ramps from "
                   f"the dims that turn beta_fast times to those that turn beta_slow times); DeepSeek-V3 uses 32 and 1")
    return out


@dataclass(frozen=True)
class MLADims:
    """The sizes of an MLA layer that ``raytron plan`` needs."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int

    @classmethod
    def of(cls, m) -> "MLADims | None":
        """From a spec's model section or a :class:`workers.config.ModelConfig`; None without MLA."""
        return cls(*(getattr(m, f) for f in MLA_FIELDS)) if m.multi_latent_attention else None

    @property
    def qk(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def parameters(self, hidden: int, heads: int, tp: int) -> int:
        """One layer's attention parameters on one TP rank: the column/row-parallel projections
        split over heads, the down projections and their norms whole."""
        q = heads * self.qk * (hidden if self.q_lora_rank is None else self.q_lora_rank) // tp
        kv = heads * (self.qk_head_dim + self.v_head_dim) * self.kv_lora_rank // tp
        return self.replicated_parameters(hidden) + q + kv + hidden * heads * self.v_head_dim // tp

    def replicated_parameters(self, hidden: int) -> int:
        """The part of :meth:`parameters` every TP rank holds whole: the down projections
        (``q_a_proj``, ``kv_a_proj_with_mqa``) and their norms. With sequence parallelism they
        see only the rank's sequence shard, so their gradients are summed over TP (as RMSNorm's)."""
        q = self.q_lora_rank * (hidden + 1) if self.q_lora_rank is not None else 0
        return q + (self.kv_lora_rank + self.qk_pos_emb_head_dim) * hidden + self.kv_lora_rank

    def flops_per_token(self, hidden: int, heads: int, seq: int) -> float:
        """Training FLOPs of one layer's attention per token, as Megatron's
        ``num_floating_point_operations`` counts MLA (fwd + bwd = 3 x 2 per multiply-add, causal halved)."""
        if self.q_lora_rank is None:
            q = hidden * heads * self.qk
        else:
            q = self.q_lora_rank * (hidden + heads * self.qk + 1)
        kv = self.kv_lora_rank * (hidden + heads * (self.qk_head_dim + self.v_head_dim) + 1)
        kv += hidden * self.qk_pos_emb_head_dim
        out = heads * self.v_head_dim * hidden
        core = seq * heads * self.qk / 2 + seq * heads * self.v_head_dim / 2
        return 6 * (q + kv + out + core)

    @property
    def ring_width(self) -> int:
        """Per head, the K and V elements of a token that go around the CP ring (both padded to one dim)."""
        return 2 * max(self.qk, self.v_head_dim)

    def activation_units(self, hidden: int, heads: int) -> tuple[float, float]:
        """Activation bytes of the attention per ``s b h`` (2-byte elements), as
        :func:`service.spec.cost.layer_activation_units` counts them: (split over TP, whole on each
        rank without SP). Split: q, the expanded k and v (padded as the ring sends them), the output,
        the fp32 log-sum-exp and the up projections' outputs; whole: the input and the latents."""
        d = max(self.qk, self.v_head_dim)
        split = (2 * heads * (self.qk + 2 * d + self.v_head_dim) + 2 * heads * (self.qk + self.v_head_dim)) / hidden
        split += 4 * heads / hidden
        latent = (self.q_lora_rank or 0) * 2 + self.kv_lora_rank * 2 + self.qk_pos_emb_head_dim
        return split, 2 + 2 * latent / hidden
