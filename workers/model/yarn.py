"""Rotary embedding of multi-latent attention: plain RoPE or YaRN, in DeepSeek's layout.

YaRN (Peng et al. 2023, arXiv 2309.00071) as DeepSeek-V3's ``rope_scaling`` and transformers'
``_compute_yarn_parameters`` compute it (Megatron-Core: ``YarnRotaryEmbedding``): each frequency
is a blend of the original one (extrapolation) and the one divided by ``rotary_scaling_factor``
(interpolation), ramped between the dims that turn ``beta_fast`` and ``beta_slow`` times over
``original_max_position_embeddings`` (the range rounded outwards, transformers' ``truncate``);
cos and sin are multiplied by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, and
the softmax scale by ``mscale(factor, mscale_all_dim)^2``.

Where transformers and Megatron-Core differ (a zero ``mscale`` or ``mscale_all_dim``), this follows
transformers: with either zero the cos/sin factor is ``mscale(factor, 1)``.

The rotary dims of q and k are DeepSeek's interleaved pairs ``(x0, x1), (x2, x3), ...``
(transformers' ``rope_interleave: true``, Megatron-Core's MLA rotary), each pair rotated by one
frequency; the rotated vector is laid out ``[evens; odds]``, as transformers returns it.
"""

from __future__ import annotations

import math

import torch

from workers.model.attention import table_dims


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor ``0.1 mscale ln(scale) + 1`` (1 when not scaling)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(cfg) -> torch.Tensor:
    """The ``qk_pos_emb_head_dim / 2`` inverse frequencies, YaRN-blended when the factor is above 1."""
    dim, base, factor = cfg.qk_pos_emb_head_dim, cfg.rotary_base, cfg.rotary_scaling_factor
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    if factor <= 1:
        return extrapolation
    interpolation = 1.0 / (factor * pos_freqs)
    original = cfg.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # no singular ramp (as transformers)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotary_attention_factor(cfg) -> float:
    """The factor of cos and sin (transformers' ``attention_factor``)."""
    factor = cfg.rotary_scaling_factor
    if cfg.mscale and cfg.mscale_all_dim:
        return float(yarn_get_mscale(factor, cfg.mscale) / yarn_get_mscale(factor, cfg.mscale_all_dim))
    return yarn_get_mscale(factor)


def mla_softmax_scale(cfg) -> float:
    """``1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, times ``mscale(factor, mscale_all_dim)^2``
    under YaRN (DeepSeek-V3, transformers' ``yarn_apply_mscale``)."""
    scale = (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5
    if cfg.rotary_scaling_factor > 1 and cfg.mscale_all_dim:
        m = yarn_get_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
        scale = scale * m * m
    return scale


def mla_rotary_tables(positions: torch.Tensor, cfg) -> torch.Tensor:
    """cos and sin (times the attention factor) of every (position, frequency),
    ``[2, s, 1, 1, qk_pos_emb_head_dim / 2]`` (per-token positions ``[s, b]``: ``[2, s, b, 1, ...]``): the layout of :func:`workers.model.decoder.rotary_tables`."""
    angles = positions.to(torch.float32)[..., None] * yarn_inv_freq(cfg).to(positions.device)
    factor = rotary_attention_factor(cfg)
    return table_dims(torch.stack([angles.cos() * factor, angles.sin() * factor]))


def apply_interleaved_rope(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, heads, d]`` (interleaved pairs) by ``rotary`` from :func:`mla_rotary_tables`;
    the result is ``[rotated evens; rotated odds]`` (transformers' ``apply_rotary_pos_emb_interleave``)."""
    cos, sin = rotary[0], rotary[1]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
