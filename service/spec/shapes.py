"""The model's sizes as the plan and the cost model count them (:class:`Shapes`), and the parameters each rank holds.

No torch: the counts follow the shapes :mod:`workers.model.decoder` builds, layer by layer on each
pipeline stage (interleaved or V-shaped), TP-, EP- and ETP-sharded; ``tests/service/spec/test_plan.py``
checks them against a real model's ``numel``. :mod:`service.spec.plan` turns them into memory and traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.spec.mla import MLADims
from workers.config import moe_layer_at
from workers.grid import ParallelGrid
from workers.parallel.pipeline import V_SHAPED, place, virtual_stage


@dataclass(frozen=True)
class Shapes:
    """The model sizes the estimates use (defaults resolved as :func:`service.spec.spec.to_job_config` does)."""

    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    seq: int
    experts: int | None
    topk: int
    mla: MLADims | None = None
    """Multi-latent attention's sizes (None: grouped-query attention)."""
    kv_channels: int | None = None
    """The head dimension when it is not hidden / heads (Qwen3)."""
    tied: bool = False
    """The output layer uses the embedding's weight (with pp = 1 it is one tensor)."""
    qkv_bias: bool = False
    qk_norm: bool = False
    # MoE routing (issue 21): the experts' ffn, the shared experts' ffn, which layers are MoE
    expert_ffn: int | None = None
    shared_ffn: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    mtp: int = 0
    """Multi-token prediction modules on the last stage (a layer, a [h, 2h] projection, 3 norms each)."""
    v_shape: bool = False
    """``parallel.pipeline_schedule: zbv``: two chunks per stage placed in a V (the first and the last
    piece, so the embedding and the output layer, on stage 0; :func:`workers.parallel.pipeline.place`)."""

    @classmethod
    def of(cls, spec) -> "Shapes":
        m = spec.model
        freq = m.moe_layer_freq
        return cls(m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups or m.num_attention_heads,
                   m.ffn_hidden_size or 4 * m.hidden_size, m.vocab_size, m.seq_length, m.num_moe_experts,
                   m.moe_router_topk, mla=MLADims.of(m), kv_channels=m.kv_channels,
                   tied=not m.untie_embeddings_and_output_weights, qkv_bias=m.add_qkv_bias, qk_norm=m.qk_layernorm,
                   expert_ffn=m.moe_ffn_hidden_size, shared_ffn=m.moe_shared_expert_intermediate_size,
                   moe_layer_freq=tuple(freq) if isinstance(freq, list) else freq, mtp=m.mtp_num_layers or 0,
                   v_shape=spec.parallel.pipeline_schedule in V_SHAPED)

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.experts) and moe_layer_at(self.moe_layer_freq, index)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads


def rank_parameters(s: Shapes, grid: ParallelGrid, rank: int) -> dict[str, int]:
    """Parameters one rank holds: ``dense`` (reduced over dp x cp) and ``expert`` (over expert dp)."""
    c = grid.coords(rank)
    tp, etp = grid.tp, grid.etp
    h, d = s.hidden, s.head_dim
    qkv = (s.heads + 2 * s.groups) * d // tp * (h + (1 if s.qkv_bias else 0))  # rows x (weight + bias)
    proj = h * s.heads * d // tp
    norms = 2 * h + (2 * d if s.qk_norm else 0)  # input and post norms; q and k norms
    if s.mla:
        qkv, proj = s.mla.parameters(h, s.heads, tp), 0
    dense_layer = qkv + proj + norms
    # This stage's layers (Megatron's interleaved assignment over pp x vpp chunks): dense MLP or MoE.
    chunks = grid.vpp or 1
    per = s.layers // (grid.pp * chunks)
    ids = [virtual_stage(c["pp"], k, grid.pp, s.v_shape) * per + i for k in range(chunks) for i in range(per)]
    moe = sum(s.is_moe_layer(i) for i in ids)
    dense = len(ids) * dense_layer + (len(ids) - moe) * 3 * s.ffn * h // tp  # gate, up (fused) and down
    expert_layer = 0
    if moe:
        # the router is replicated; shared experts are TP-sharded like the dense MLP
        dense += moe * (s.experts * h + 3 * (s.shared_ffn or 0) * h // tp)
        expert_layer = (s.experts // grid.ep) * 3 * (s.expert_ffn or s.ffn) * h // etp
    padded = -(-s.vocab // tp) * tp
    if c["pp"] == 0:
        dense += padded // tp * h
    if c["pp"] == place(grid.pp * chunks - 1, grid.pp, s.v_shape)[0]:  # the output layer's stage
        dense += (0 if s.tied and grid.pp == 1 else padded // tp * h) + h
        if s.mtp:  # layers of the last layer's kind, eh_proj, 3 norms; the embedding's copy (pp > 1, untied)
            last_moe = s.is_moe_layer(s.layers - 1)
            mlp = s.experts * h + 3 * (s.shared_ffn or 0) * h // tp if last_moe else 3 * s.ffn * h // tp
            dense += s.mtp * (dense_layer + mlp + 2 * h * h // tp + 3 * h)
            dense += padded // tp * h if grid.pp > 1 and not s.tied else 0
            moe += s.mtp if last_moe else 0
    return {"dense": dense, "expert": moe * expert_layer}


def model_parameters(s: Shapes) -> int:
    """Parameters of the whole, unsharded model (the vocabulary unpadded)."""
    one = ParallelGrid(1)
    p = rank_parameters(s, one, 0)
    return p["dense"] + p["expert"]
