"""The rules between the model's sizes and the parallel layout, and Megatron's recompute rules.

Heads, query groups, the ffn, layers, the sequence and the experts must divide by the layout's
tp, pp (x vpp), cp (x 2) and ep, a TP group must fit in a node, and the recompute fields must
agree (Megatron-Core's ``TransformerConfig`` checks). Each message names the fields, the numbers
and the fix; :func:`service.spec.spec.spec_problems` gathers them with every other rule.
"""

from __future__ import annotations

from service.spec.context import cp_problems
from service.spec.model_section import ModelSpec
from service.spec.moe import moe_problems
from service.spec.sections import ParallelSpec


def layout_problems(m: ModelSpec, p: ParallelSpec, gpus_per_node: int) -> list[str]:
    """Problems of the model's sizes under a concrete parallel section on nodes of ``gpus_per_node``."""
    out: list[str] = []
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.expert_model_parallel_size)
    etp = p.expert_tensor_parallel_size or tp
    vpp = p.virtual_pipeline_model_parallel_size
    if p.overlap_param_gather and p.use_distributed_optimizer is False:
        out.append("parallel.overlap_param_gather needs parallel.use_distributed_optimizer: true (it overlaps the "
                   "distributed optimizer's param all-gather); set both, or drop overlap_param_gather")
    if tp > gpus_per_node:
        out.append(f"parallel.tensor_model_parallel_size {tp} > resources.gpus_per_node {gpus_per_node}: "
                   f"a TP group must stay inside one node; lower tp or raise gpus_per_node")
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    if m.hidden_size % heads and not m.kv_channels and not m.multi_latent_attention:  # MLA: its own head dims
        out.append(f"model.hidden_size {m.hidden_size} is not divisible by model.num_attention_heads {heads}; "
                   f"set model.kv_channels (the head dimension) or a head count that divides it")
    if heads % groups:
        out.append(f"model.num_attention_heads {heads} is not divisible by model.num_query_groups {groups}")
    if heads % tp:
        out.append(f"model.num_attention_heads {heads} is not divisible by tensor_model_parallel_size {tp}; "
                   f"use a tp that divides {heads}")
    if groups % tp:
        out.append(f"model.num_query_groups {groups} is not divisible by tensor_model_parallel_size {tp}; "
                   f"use a tp that divides {groups} or more query groups")
    out.extend(cp_problems(p, heads, tp))
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp:
        out.append(f"model.ffn_hidden_size {ffn} is not divisible by tensor_model_parallel_size {tp}")
    if m.multi_latent_attention:
        pass  # MLA's head dims are its own fields (service/spec/mla.py)
    elif m.kv_channels and m.kv_channels % 2:
        out.append(f"model.kv_channels {m.kv_channels} must be even for rotary embeddings; use {m.kv_channels + 1}")
    elif not m.kv_channels and (m.hidden_size // heads) % 2:
        out.append(f"head dim hidden_size/heads = {m.hidden_size // heads} must be even for rotary embeddings")
    chunks = pp * (vpp or 1)
    if m.num_layers % chunks:
        what = f"pipeline_model_parallel_size {pp}" + (f" x virtual_pipeline_model_parallel_size {vpp}" if vpp else "")
        out.append(f"model.num_layers {m.num_layers} is not divisible by {what} = {chunks}; "
                   f"use a layer count that is a multiple of {chunks}")
    seq_div = (2 * cp if cp > 1 else 1) * (tp if p.sequence_parallel else 1)
    if m.seq_length % seq_div:
        parts = (["2 x context_parallel_size " + str(cp)] if cp > 1 else []) + \
                (["tensor_model_parallel_size " + str(tp) + " (sequence_parallel)"] if p.sequence_parallel else [])
        out.append(f"model.seq_length {m.seq_length} is not divisible by {' x '.join(parts)} = {seq_div}; "
                   f"use a multiple of {seq_div}")
    if m.num_moe_experts:
        if m.num_moe_experts % ep:
            out.append(f"model.num_moe_experts {m.num_moe_experts} is not divisible by expert_model_parallel_size {ep}")
        if m.moe_router_topk > m.num_moe_experts:
            out.append(f"model.moe_router_topk {m.moe_router_topk} > model.num_moe_experts {m.num_moe_experts}")
        if tp > 1 and not p.sequence_parallel:
            out.append(f"MoE with tensor_model_parallel_size {tp} needs parallel.sequence_parallel: true "
                       f"(as in Megatron-Core)")
    elif ep > 1:
        out.append(f"expert_model_parallel_size {ep} needs model.num_moe_experts (a dense model has no experts)")
    out.extend(moe_problems(m, tp, etp))
    return out


def recompute_problems(m: ModelSpec, pp: int) -> list[str]:
    """Megatron's TransformerConfig rules for the recompute fields."""
    g, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    per_stage = m.num_layers // pp
    if g is None:
        return [f"model.{k} needs model.recompute_granularity (full or selective)"
                for k, v in (("recompute_method", method), ("recompute_num_layers", n)) if v is not None]
    if g == "selective":
        return [f"model.{k} is for recompute_granularity: full; unset it with selective"
                for k, v in (("recompute_method", method), ("recompute_num_layers", n)) if v is not None]
    out = []
    if method is None:
        out.append("model.recompute_granularity: full needs model.recompute_method: uniform or block")
    if n is None or not 1 <= n <= per_stage:
        out.append(f"model.recompute_granularity: full needs model.recompute_num_layers between 1 and the layers "
                   f"per pipeline stage ({per_stage}), got {n}")
    return out
