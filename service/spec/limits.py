"""Sizes checked arithmetically before anything is enumerated or allocated.

A world size is capped before a grid lists its groups (listing a billion ranks would exhaust
memory long before it failed), and a job whose per-rank parameters, gradients and optimizer
state cannot fit any accelerator is refused with the estimate.
"""

from __future__ import annotations

from service.spec.mla import MLADims
from workers.config import JobConfig

MAX_WORLD_SIZE = 65536
"""Ranks a job (or ``raytron grid``) may have; more than the largest clusters trained on."""

MAX_PRIORITY = 10**6
"""The largest queue priority, either way (``priority`` in a job spec)."""

MAX_RANK_STATE_GIB = 192.0
"""Per-rank bytes for parameters + gradients + Adam state that no accelerator holds more of."""

BYTES_PER_PARAM = 16  # fp32 weight 4 + fp32 grad 4 + Adam moments 8


def check_world_size(world_size: int, what: str = "world_size") -> None:
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"{what} {world_size} is larger than the supported {MAX_WORLD_SIZE} ranks; "
                         f"use at most {MAX_WORLD_SIZE}")


def rank_params(job: JobConfig) -> int:
    """Parameters on the busiest rank: its share of the layers, plus embedding and output layer
    (first and last pipeline stage; counted together, as when pp = 1)."""
    m, p = job.model, job.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or tp
    h, f, hd = m.hidden_size, m.ffn_hidden_size, m.head_dim
    attention = h * (m.num_attention_heads + 2 * m.num_query_groups) * hd // tp + m.num_attention_heads * hd * h // tp
    if m.multi_latent_attention:
        attention = MLADims.of(m).parameters(h, m.num_attention_heads, tp)
    if m.is_moe:
        mlp = m.num_moe_experts // ep * 3 * h * m.expert_ffn_hidden_size // etp + h * m.num_moe_experts
    else:
        mlp = 3 * h * f // tp
    per_layer = attention + mlp + 2 * h
    layers = -(-m.num_layers // pp)
    mtp = (m.mtp_num_layers or 0) * (per_layer + 2 * h * h // tp)  # on the last stage with the output layer
    return layers * per_layer + mtp + 2 * m.vocab_size * h // tp + h


def check_memory(job: JobConfig) -> None:
    """Refuse a job whose per-rank parameter + optimizer memory cannot fit (with the estimate)."""
    params = rank_params(job)
    gib = params * BYTES_PER_PARAM / 2**30
    if job.parallel.use_distributed_optimizer:
        gib = params * 8 / 2**30 + params * 8 / 2**30 / max(1, job.world_size)  # Adam state sharded over dp
    if gib > MAX_RANK_STATE_GIB:
        p = job.parallel
        raise ValueError(
            f"the model needs about {gib:,.0f} GiB per rank for parameters, gradients and Adam state "
            f"({params:,} parameters on the busiest rank at tensor_model_parallel_size "
            f"{p.tensor_model_parallel_size}, pipeline_model_parallel_size {p.pipeline_model_parallel_size}), "
            f"more than the {MAX_RANK_STATE_GIB:g} GiB any accelerator holds; shrink model.hidden_size / "
            f"num_layers or raise tensor/pipeline parallelism")
