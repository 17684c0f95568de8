"""The cost model of ``raytron plan``: memory per rank and step time of one layout. Pure, no torch.

**Cluster figures**: :mod:`service.spec.cluster_figures` (:func:`cluster_of` a spec's ``resources``);
on the simulated CPU cluster the step time is :mod:`service.spec.cost_cpu`'s instead of the one below.

**Memory per rank** (:func:`state_bytes`, :func:`activation_bytes`), for the most loaded rank:

* parameters, gradients and Adam state, as Megatron's ``compute_weight_and_optimizer_memory``
  (megatron/training/theoretical_memory_usage.py): bf16/fp16 mixed precision 18 bytes per
  parameter (2 weight + 4 fp32 grad + 4 fp32 master + 8 moments), with the distributed optimizer
  ``6 + 12/n``; fp32 (the trainer's default) 16, distributed ``8 + 8/n`` (the fp32 params are their
  own main params) as :mod:`service.spec.plan` states. ``n`` is dp x cp for dense weights, expert dp for expert weights. Each term is a tensor
  :mod:`workers.parallel.optimizer` allocates (:func:`state_bytes`), plus the distributed
  optimizer's scratch: gloo's staging of one (in-place) all-gather bucket and of two reduce-scatters.
* activations per Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, re-derived for this model
  (RMSNorm, SwiGLU, GQA, no dropout, flash attention), bytes per layer per microbatch in units of
  ``s b h`` (s = seq / cp, 2-byte elements; fp32 doubles it): tensors every TP rank holds whole
  without SP: 2 norm inputs + QKV input + fc1 input = 8; split over TP: Q 2, K and V 4 g/a, the
  attention output 2, flash attention's fp32 log-sum-exp 4 a/h, SwiGLU's gate and up 4 f/h and its
  product 2 f/h. With SP everything is split over TP. No ``5 a s / h`` softmax term (flash attention
  keeps none), so selective recompute (the attention core) saves nothing here and is never chosen.
  MoE replaces the MLP: norm 2, router input 2, fp32 router logits 4 E/h, routed tokens and their
  outputs 4 k, the experts' SwiGLU 6 k f/h. Full recompute keeps each recomputed layer's input
  (2) and, in backward, one recompute group whole. The first stage holds min(pp, microbatches)
  microbatches in flight (1F1B), pp x (1 + (pp-1)/(pp vpp)) interleaved; the last stage one, plus
  the output layer: its input, the logits the cross-entropy saves and, live with every activation
  when backward starts, the logits' fp32 gradient (``4 s b V / tp``; bf16/fp16 also its cast copy).
  Checked on CPU against what autograd saves (``saved_tensors_hooks``: 141 MB saved against 132
  counted for a 6-layer h-512 model) and the process's peak (``bench/auto_layout_bench.py --memory``). Multi-latent attention's
  terms replace the attention's (:meth:`service.spec.mla.MLADims.activation_units`).

**Step time** on accelerators (:func:`step_time`): Megatron's FLOPs (``num_floating_point_operations``, causal
attention halved; its MLA count with multi-latent attention) over peak x :data:`EFFICIENCY`; the bubble of the work of one
stage by ``parallel.pipeline_schedule`` (:func:`service.spec.pipeline.bubble_fraction`: ``(pp-1)/(vpp m)`` for 1F1B
and interleaved, a third of 1F1B's for ZB-H1, a sixth for ZBV); TP, CP, EP and PP bytes from :mod:`service.spec.plan`'s traffic (one traffic model) over
the bandwidth of each hop, the slowest rank counting (a ring moves at its slowest hop), not
overlapped; DP gradients overlapped with the last microbatch's backward (the all-gather of the
distributed optimizer after the step is not).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.spec.cluster_figures import CPU_FIGURES, Cluster, cluster_of, gpu_type_of  # noqa: F401 (re-exported)
from service.spec.pipeline import bubble_fraction

EFFICIENCY = 0.5
"""Achieved / peak FLOP/s of the GEMMs (model FLOPs utilisation before communication and bubble)."""

MEMORY_MARGIN = 0.85
"""A layout fits when its peak bytes are at most this share of the accelerator's memory (the rest:
CUDA context, NCCL buffers, allocator fragmentation, temporaries)."""


BUCKET_ELEMENTS = 1_000_000
"""The trainer's gradient bucket (``workers.parallel.data.DEFAULT_BUCKET_SIZE``, elements)."""
SCATTERS_IN_FLIGHT = 2
"""Reduce-scatters in flight at most (``workers.parallel.grad_buffer.MAX_SCATTERS_IN_FLIGHT``)."""


def grad_bytes(training) -> int:
    """Bytes per gradient element, in the buffer and on the wire of the DP reduction:
    ``training.main_grads_dtype``'s (fp32 4, fp64 8)."""
    return 8 if training.main_grads_dtype == "fp64" else 4


def state_bytes(dense: float, expert: float, dense_shards: int, expert_shards: int, *, mixed: bool,
                distributed: bool, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state of one rank holding ``dense`` and ``expert``
    parameters, whose optimizer state the distributed optimizer shards ``dense_shards`` /
    ``expert_shards`` ways: the tensors :mod:`workers.parallel.optimizer` allocates.

    * weights: the model params (fp32 4, bf16/fp16 2 bytes); the replicated optimizer's flat
      main buffer *is* them in fp32 (the params are views of it);
    * gradients: the flat gradient buffer, ``grad_bytes`` per element (fp32 4, ``main_grads_dtype:
      fp64`` 8; the distributed optimizer reduce-scatters into it in place, as Megatron);
    * optimizer: the two fp32 moments (8), plus the fp32 main params where they are not the
      model's (bf16/fp16: 4); the distributed optimizer keeps them for its shard only (12 / n;
      fp32 8 / n: its main params are its slices of the model's flat param buffer);
    * scratch (distributed only): gloo's staging of the in-place param all-gather (one bucket in
      the params' dtype) and of each reduce-scatter in flight (:data:`SCATTERS_IN_FLIGHT`
      gradient buckets).
    """
    params = dense + expert
    weight = 2 if mixed else 4
    shard = dense / dense_shards + expert / expert_shards
    grad = grad_bytes * params
    if distributed:
        optimizer = (12 if mixed else 8) * shard
        bucket = min(BUCKET_ELEMENTS, params)
        scratch = bucket * weight + SCATTERS_IN_FLIGHT * bucket * grad_bytes
    else:
        optimizer = (12 if mixed else 8) * params
        scratch = 0.0
    return {"weights": weight * params, "gradients": grad, "optimizer": optimizer, "scratch": scratch,
            "total": weight * params + grad + optimizer + scratch}


def layer_activation_units(s, *, tp: int, sp: bool) -> float:
    """Activation bytes of one layer per ``s b h`` tokens-x-hidden, 2-byte elements (module docstring)."""
    h, a, g, f = s.hidden, s.heads, s.groups, s.ffn
    split_attention = 2 + 4 * g / a + 2 + 4 * a / h
    whole_attention = 2 + 2
    if s.mla:
        split_attention, whole_attention = s.mla.activation_units(h, a)
    if s.experts:  # every layer counted as MoE (an upper bound with moe_layer_freq), plus shared experts
        f = s.expert_ffn or f
        split_mlp, whole_mlp = 2 + 4 * s.experts / h + 4 * s.topk + 6 * s.topk * f / h, 2
        split_mlp += 6 * (s.shared_ffn or 0) / h
    else:
        split_mlp, whole_mlp = 6 * f / h, 2 + 2
    split = (split_attention + split_mlp) / tp
    whole = whole_attention + whole_mlp
    return split + (whole / tp if sp else whole)


def activation_bytes(s, *, tp: int, pp: int, cp: int, vpp: int | None, sp: bool, micro_batch_size: int,
                     num_microbatches: int, recompute: str | None, recompute_method: str | None,
                     recompute_num_layers: int | None, element_bytes: int, schedule: str | None = None) -> dict[str, float]:
    """Peak activation bytes of the most loaded pipeline stage (first or last), with the parts."""
    sbh = s.seq // cp * micro_batch_size * s.hidden * element_bytes / 2
    full_layer = layer_activation_units(s, tp=tp, sp=sp) * sbh
    layer_input = 2 * sbh / (tp if sp else 1)
    stage_layers = s.layers // pp
    if recompute == "full":
        n = recompute_num_layers or 1
        if recompute_method == "block":
            kept, working = (stage_layers - n) * full_layer + n * layer_input, 0.0
        else:  # uniform: one input per group of n layers; backward rebuilds one group whole
            kept, working = -(-stage_layers // n) * layer_input, n * full_layer
    else:  # none or selective (flash attention already keeps no s^2 tensor: the same bytes)
        kept, working = stage_layers * full_layer, 0.0
    if vpp and schedule != "zbv":  # ZBV: 2 pp half-stage chunks, 1F1B's pp stages' worth
        in_flight = min(pp * (1 + (pp - 1) / (pp * vpp)), num_microbatches * 1.0)
    else:
        in_flight = min(pp, num_microbatches)
    tokens = s.seq // cp * micro_batch_size
    embedding = 8 * tokens * in_flight  # int64 token ids
    # final norm in/out, the logits (saved by the cross-entropy) and, when backward starts with
    # every activation still held, the logits' fp32 gradient (bf16/fp16: plus its cast copy)
    vocab = -(-s.vocab // tp)
    logits_grad = tokens * vocab * (4 + (element_bytes if element_bytes != 4 else 0))
    output = 2 * sbh * 2 / (tp if sp else 1) + tokens * vocab * element_bytes + logits_grad
    first = kept * in_flight + working + embedding
    last = kept + working + output
    if pp == 1:
        first = last = kept + working + embedding + output
    peak = max(first, last)
    return {"layers": kept * (in_flight if first >= last else 1), "recompute_working": working,
            "embedding": embedding if first >= last else 0.0, "output_layer": output if last > first or pp == 1
            else 0.0, "logits_grad": logits_grad if last > first or pp == 1 else 0.0, "in_flight_microbatches": in_flight if first >= last else 1, "total": peak}


def megatron_flops(s, batch: int, *, recompute: str | None = None) -> float:
    """Training FLOPs of ``batch`` sequences by Megatron's ``num_floating_point_operations``
    (megatron/training/training.py): 12 s L h^2 x (attention (1 + g/a + s/(2h)) + MLP 1.5 f/h x topk
    + logits V/(2 L h)), causal attention halved. Full recompute adds one forward of the layers."""
    h, L = s.hidden, s.layers
    attention = (1 + s.groups / s.heads + s.seq / h / 2) * (s.heads * s.head_dim / h)
    if s.mla:  # Megatron's MLA count, in the same units
        attention = s.mla.flops_per_token(h, s.heads, s.seq) / (12 * h * h)
    # Per layer on average, as Megatron: dense layers' ffn, MoE layers' topk x expert ffn + shared ffn.
    moe = sum(s.is_moe_layer(i) for i in range(L)) if s.experts else 0
    moe_ffn = (s.expert_ffn or s.ffn) * s.topk + (s.shared_ffn or 0)
    mlp = ((L - moe) * s.ffn + moe * moe_ffn) / L / h * 1.5
    logits = s.vocab / (2 * L * h)
    # MTP (getattr: shapes without the field): D more layers, D more logits, a [h, 2h] projection each
    mtp = getattr(s, "mtp", 0)
    total = 12 * batch * s.seq * h * h * ((L + mtp) * (attention + mlp) + (1 + mtp) * L * logits + mtp)
    if recompute == "full":
        total += 12 * batch * s.seq * h * h * L * (attention + mlp) / 3
    return total


def comm_seconds(rank_bytes: dict[str, dict[int, tuple[float, float]]], cluster: Cluster,
                 scale: dict[str, float]) -> dict[str, float]:
    """Per kind, the slowest rank's time to send its bytes (in-node, cross-node) of one iteration."""
    out = {}
    for kind, per_rank in rank_bytes.items():
        worst = 0.0
        for in_node, cross in per_rank.values():
            worst = max(worst, (in_node / cluster.intra_bytes_per_s + cross / cluster.inter_bytes_per_s)
                        * scale.get(kind, 1.0))
        out[kind] = worst
    return out


def step_time(s, *, world: int, pp: int, vpp: int | None, global_batch_size: int, num_microbatches: int,
              recompute: str | None, comm: dict[str, float], cluster: Cluster,
              distributed: bool, schedule: str | None = None) -> dict[str, float]:
    """Predicted seconds of one iteration, by part (module docstring)."""
    compute = megatron_flops(s, global_batch_size) / world / (cluster.peak_flops * EFFICIENCY)
    recompute_s = (megatron_flops(s, global_batch_size, recompute=recompute) / world
                   / (cluster.peak_flops * EFFICIENCY) - compute)
    exposed = {k: comm.get(k, 0.0) for k in ("tp", "cp", "ep", "pp")}
    work = compute + recompute_s + sum(exposed.values())
    bubble = work * bubble_fraction(schedule, pp, vpp, num_microbatches)
    dp = comm.get("dp", 0.0)
    window = compute * 2 / 3 / num_microbatches  # the last microbatch's backward on one stage
    if distributed:  # reduce-scatter overlapped; the all-gather after the step is not
        dp_exposed = max(0.0, dp / 2 - window) + dp / 2
    else:
        dp_exposed = max(0.0, dp - window)
    total = work + bubble + dp_exposed
    return {"compute": compute, "recompute": recompute_s, **exposed, "bubble": bubble, "dp": dp,
            "dp_exposed": dp_exposed, "total": total}
