"""The decoder's attention and its norm: RMSNorm, rotary tables, and grouped-query attention
with a fused column-parallel QKV (per query group: its q heads, k, v), optionally with a bias
(Qwen2, ``add_qkv_bias``) and RMSNorm over each q and k head before RoPE (Qwen3,
``qk_layernorm``), heads of ``kv_channels`` dims, context-parallel core, row-parallel output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from workers.config import ModelConfig
from workers.model.fused import rms_norm, rotary_qkv, rotary_qkv_tables
from workers.parallel.context import context_parallel_attention
from workers.parallel.initializer import Cat, NormalInit, Zeros
from workers.parallel.sequence import mark_sequence_parallel
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from workers.parallel.recompute import checkpointed


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, sequence_parallel: bool):
        super().__init__()
        self.eps = eps
        # eps as a tensor: the fused norm adds it inside an addcmul (one op fewer per call).
        self.register_buffer("eps_tensor", torch.tensor(eps, dtype=torch.float32), persistent=False)
        # On sequence shards each TP rank sees part of the tokens: its grad is partial.
        self.weight = mark_sequence_parallel(nn.Parameter(torch.ones(hidden)), sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 under bf16/fp16 (as Megatron's fused norms), in one op.
        # The tensor eps only in fp32: ``.to(bf16)`` casts buffers, and a bf16 eps would change the math.
        return rms_norm(x, self.weight, self.eps_tensor if x.dtype == torch.float32 else self.eps)


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """cos and sin of every (position, frequency), ``[2, s, 1, 1, head_dim / 2]``; for per-token
    positions ``[s, b]`` (packed documents) ``[2, s, b, 1, head_dim / 2]``.

    Positions are fixed per rank (its CP chunks), so a chunk computes this once, not per layer;
    packed documents' positions restart per document, so those tables are made per microbatch.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    return table_dims(torch.stack([angles.cos(), angles.sin()]))


def table_dims(table: torch.Tensor) -> torch.Tensor:
    """``[2, s, f]`` -> ``[2, s, 1, 1, f]``, ``[2, s, b, f]`` -> ``[2, s, b, 1, f]``: broadcastable over heads."""
    return table[:, :, None, None, :] if table.dim() == 3 else table[:, :, :, None, :]


@dataclass
class PackedRotary:
    """What the layers of a packed microbatch get instead of the chunk's rotary buffer: the rotary
    tables of its position ids (restarting at every document) and its documents (each batch row's
    ``cu_seqlens``), which the attention core honours (:func:`workers.parallel.context.context_parallel_attention`)."""

    tables: torch.Tensor
    docs: tuple
    _qkv: dict = field(default_factory=dict)

    def qkv_tables(self, slots: int):
        """:func:`rotary_qkv_tables` of ``tables``, made once per microbatch (every layer shares them)."""
        if slots not in self._qkv:
            self._qkv[slots] = rotary_qkv_tables(self.tables, slots)
        return self._qkv[slots]


def rotary_and_docs(rotary) -> tuple[torch.Tensor, tuple | None]:
    """``(rotary tables, documents)`` of a layer's ``rotary`` argument (a tensor or :class:`PackedRotary`)."""
    return (rotary.tables, rotary.docs) if isinstance(rotary, PackedRotary) else (rotary, None)


def _fused_qkv(cfg: ModelConfig, seed: int, prefix: str) -> Cat:
    """Full QKV weight laid out per query group: [q heads of group g, k_g, v_g] for g in groups.

    With that layout a contiguous row split over tp gives each rank whole query groups,
    Megatron's layout for grouped-query attention. Lazy: a rank makes only its groups.
    """
    d, h, ng = cfg.head_dim, cfg.hidden_size, cfg.num_query_groups
    per_group = cfg.num_attention_heads // ng
    std = cfg.init_method_std
    q = NormalInit(seed, f"{prefix}.q", (ng * per_group * d, h), std)
    k = NormalInit(seed, f"{prefix}.k", (ng * d, h), std)
    v = NormalInit(seed, f"{prefix}.v", (ng * d, h), std)
    return _per_group(cfg, q, k, v)


def _per_group(cfg: ModelConfig, q, k, v) -> Cat:
    """Full q, k, v (weights or biases) interleaved per query group along dim 0."""
    d, ng = cfg.head_dim, cfg.num_query_groups
    per_group = cfg.num_attention_heads // ng
    parts = []
    for g in range(ng):
        parts += [q.narrow(0, g * per_group * d, per_group * d), k.narrow(0, g * d, d), v.narrow(0, g * d, d)]
    return Cat(parts)


class Attention(nn.Module):
    """``ctx`` is the rank's :class:`workers.model.decoder.ShardContext` (its groups and settings)."""

    def __init__(self, cfg: ModelConfig, ctx, prefix: str):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        sp = ctx.sequence_parallel
        bias = None
        if cfg.add_qkv_bias:  # zeros at init, as Megatron's (and transformers') linear biases
            d, ng, heads = cfg.head_dim, cfg.num_query_groups, cfg.num_attention_heads
            bias = _per_group(cfg, Zeros((heads * d,)), Zeros((ng * d,)), Zeros((ng * d,)))
        self.qkv = ColumnParallelLinear(_fused_qkv(cfg, ctx.seed, prefix), ctx.tp_group, sequence_parallel=sp,
                                        full_bias=bias)
        if cfg.qk_layernorm:
            # Each TP rank normalises its own heads: the replicated weights' grads are partial
            # over TP, so they reduce over tp-dp-cp as the sequence-parallel weights do.
            partial = sp or ctx.tp_size > 1
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_epsilon, partial)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_epsilon, partial)
        proj = NormalInit(ctx.seed, f"{prefix}.proj", (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim),
                          cfg.init_method_std)
        self.proj = RowParallelLinear(proj, ctx.tp_group, sequence_parallel=sp)
        self._rope_key = None  # which rotary buffer the RoPE tables below were built from

    def _rope_tables(self, rotary: torch.Tensor, slots: int):
        # Built once per rotary buffer (it changes only when the chunk is cast or moved). Kept
        # as (non-persistent) buffers: constants of the layout, not activations, though the
        # RoPE node saves them for backward.
        key = (rotary.data_ptr(), rotary.dtype, rotary.device, rotary._version, slots)
        if self._rope_key != key:
            for name, table in zip(("rope_cos", "rope_sin", "rope_sin_back"), rotary_qkv_tables(rotary, slots)):
                self.register_buffer(name, table, persistent=False)
            self._rope_key = key
        return self.rope_cos, self.rope_sin, self.rope_sin_back

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``x``, plus ``residual`` if given (folded into the output GEMM)."""
        cfg, d = self.cfg, self.cfg.head_dim
        groups = cfg.num_query_groups // self.ctx.tp_size
        per_group = cfg.num_attention_heads // cfg.num_query_groups
        qkv = self.qkv(x)  # [s, b, groups * (per_group + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, groups, per_group + 2, d)
        if cfg.qk_layernorm:  # Qwen3: RMSNorm over each q and k head, before RoPE
            qkv = torch.cat([self.q_norm(qkv[:, :, :, :per_group]), self.k_norm(qkv[:, :, :, per_group:per_group + 1]),
                             qkv[:, :, :, per_group + 1:]], dim=3)
        # RoPE on q and k and the split, as one autograd node (workers.model.fused).
        packed = isinstance(rotary, PackedRotary)
        tables = rotary.qkv_tables(per_group + 2) if packed else self._rope_tables(rotary, per_group + 2)
        q, k, v = rotary_qkv(qkv, tables)
        docs = rotary.docs if packed else None
        if self.cfg.recompute_granularity == "selective":
            out = checkpointed(self._core, q, k, v, docs)  # Megatron's selective: the attention core
        else:
            out = self._core(q, k, v, docs)
        return self.proj(out.reshape(s, b, -1), residual)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: tuple | None = None) -> torch.Tensor:
        return context_parallel_attention(q, k, v, group=self.ctx.cp_group, ranks=self.ctx.cp_ranks,
                                          comm_type=self.ctx.cp_comm_type, hierarchy=self.ctx.hcp_groups, docs=docs,
                                          dtype=self.ctx.attention_dtype)
