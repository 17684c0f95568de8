"""Multi-latent attention (MLA, DeepSeek-V2/V3), tensor-, sequence-, context- and pipeline-parallel.

The parameters are transformers' ``DeepseekV3Attention``'s, named as there, so a Hugging Face
checkpoint maps 1:1 (the TP-sharded ones by contiguous slices of whole heads):

* ``q_a_proj [q_lora_rank, hidden]``, ``q_a_layernorm [q_lora_rank]`` and
  ``q_b_proj [heads (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank]``; or, with
  ``q_lora_rank: null``, ``q_proj [heads (qk_head_dim + qk_pos_emb_head_dim), hidden]``;
* ``kv_a_proj_with_mqa [kv_lora_rank + qk_pos_emb_head_dim, hidden]``, ``kv_a_layernorm
  [kv_lora_rank]``, ``kv_b_proj [heads (qk_head_dim + v_head_dim), kv_lora_rank]``;
* ``o_proj [hidden, heads v_head_dim]``.

Each head's query is ``[nope; rope]``; its key is ``[its nope part of kv_b_proj(latent); the one
rotary key]``: the rotary key comes from ``kv_a_proj_with_mqa`` and is shared by every head.

Parallelism as Megatron-Core's ``MLASelfAttention``: ``q_b_proj`` / ``q_proj`` and ``kv_b_proj``
are column-parallel over heads, ``o_proj`` row-parallel; the down projections and their norms
are replicated over TP and run on the layer's input as it comes (with sequence parallelism,
this rank's sequence shard: the up projections gather the normalised latents). Their gradients:
without SP every TP rank sees every token and the up projections' backward already sums the
heads' contributions, so they are complete; with SP each rank saw its own tokens, so they are
marked sequence-parallel and summed over TP after backward, as the RMSNorm weights are. The
rotary key feeds only this rank's heads: its gradient is summed over TP (with SP by the
reduce-scatter of its sequence gather, without by an all-reduce).

With context parallelism K and V are expanded from the latent on each rank's own tokens and go
around the ring (or are all-gathered) as for any attention; the ring needs one head dim, so
whichever of ``qk_head_dim + qk_pos_emb_head_dim`` and ``v_head_dim`` is smaller is padded with
zeros (which change neither ``q . k`` nor the output) and the padding cut off after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.config import ModelConfig
from workers.model.attention import rotary_and_docs
from workers.parallel.context import context_parallel_attention
from workers.parallel.initializer import NormalInit, materialize
from workers.parallel.sequence import gather_from_sequence_parallel_region, mark_sequence_parallel
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear, copy_to_tensor_parallel_region
from workers.parallel.recompute import checkpointed
from workers.model.yarn import apply_interleaved_rope, mla_softmax_scale


class ReplicatedLinear(nn.Module):
    """``y = x @ W.T`` with W whole on every TP rank (a down projection). No bias.

    With ``sequence_parallel`` it runs on this rank's sequence shard, so its gradient is partial
    over TP: the weight is marked for :func:`workers.parallel.sequence.allreduce_sequence_parallel_grads`.
    """

    def __init__(self, full_weight, *, sequence_parallel: bool):
        super().__init__()
        self.weight = mark_sequence_parallel(nn.Parameter(materialize(full_weight).detach().clone()),
                                             sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MLAttention(nn.Module):
    """Multi-latent attention of a decoder layer; the interface of :class:`workers.model.decoder.Attention`.

    Args:
        cfg: the model.
        ctx: the rank's :class:`workers.model.decoder.ShardContext`.
        prefix: the parameter names' prefix (``layers.5.attention``): their seeds.
        norm: the model's RMSNorm class (``norm(dim, eps, sequence_parallel)``), passed in so that
            this module does not import the model that builds it.
    """

    def __init__(self, cfg: ModelConfig, ctx, prefix: str, *, norm):
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        sp, tp, std, seed = ctx.sequence_parallel, ctx.tp_group, cfg.init_method_std, ctx.seed
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim

        def init(name, shape):
            return NormalInit(seed, f"{prefix}.{name}", shape, std)

        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(init("q_proj", (heads * qk, h)), tp, sequence_parallel=sp)
        else:
            self.q_a_proj = ReplicatedLinear(init("q_a_proj", (cfg.q_lora_rank, h)), sequence_parallel=sp)
            self.q_a_layernorm = norm(cfg.q_lora_rank, cfg.norm_epsilon, sp)
            self.q_b_proj = ColumnParallelLinear(init("q_b_proj", (heads * qk, cfg.q_lora_rank)), tp,
                                                 sequence_parallel=sp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            init("kv_a_proj_with_mqa", (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, h)), sequence_parallel=sp)
        self.kv_a_layernorm = norm(cfg.kv_lora_rank, cfg.norm_epsilon, sp)
        self.kv_b_proj = ColumnParallelLinear(
            init("kv_b_proj", (heads * (cfg.qk_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)), tp,
            sequence_parallel=sp)
        self.o_proj = RowParallelLinear(init("o_proj", (h, heads * cfg.v_head_dim)), tp, sequence_parallel=sp)
        self.softmax_scale = mla_softmax_scale(cfg)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``x`` (``[s, b, hidden]``, or its sequence shard with SP), plus ``residual``
        if given. ``rotary``: :func:`workers.model.yarn.mla_rotary_tables` of this rank's positions."""
        cfg = self.cfg
        nope, rope = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim
        rotary, docs = rotary_and_docs(rotary)
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        s, b = q.shape[:2]
        q_nope, q_pe = q.view(s, b, -1, nope + rope).split([nope, rope], dim=-1)
        heads = q_nope.shape[2]  # this rank's
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(s, b, heads, nope + cfg.v_head_dim)
        k_nope, v = kv.split([nope, cfg.v_head_dim], dim=-1)
        k_pe = apply_interleaved_rope(self._whole_sequence(k_pe).unsqueeze(2), rotary)  # [s, b, 1, rope]
        q = torch.cat([q_nope, apply_interleaved_rope(q_pe, rotary)], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(s, b, heads, rope)], dim=-1)
        if cfg.recompute_granularity == "selective":
            out = checkpointed(self._core, q, k, v, docs)
        else:
            out = self._core(q, k, v, docs)
        return self.o_proj(out.reshape(s, b, -1), residual)

    def _whole_sequence(self, k_pe: torch.Tensor) -> torch.Tensor:
        """The rotary key of every token of the rank's sequence, its gradient summed over TP."""
        if self.ctx.sequence_parallel:
            return gather_from_sequence_parallel_region(k_pe, self.ctx.tp_group, tensor_parallel_output_grad=True)
        return copy_to_tensor_parallel_region(k_pe, self.ctx.tp_group)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: tuple | None = None) -> torch.Tensor:
        dv = v.shape[-1]
        d = max(q.shape[-1], dv)
        q, k, v = (t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1])) for t in (q, k, v))
        out = context_parallel_attention(q, k, v, group=self.ctx.cp_group, ranks=self.ctx.cp_ranks,
                                         softmax_scale=self.softmax_scale, comm_type=self.ctx.cp_comm_type,
                                         hierarchy=self.ctx.hcp_groups, docs=docs, dtype=self.ctx.attention_dtype)
        return out if dv == d else out[..., :dv]
