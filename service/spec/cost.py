"""The cost model of ``raytron plan``: memory per rank and step time of one layout. Pure, no torch.

**Cluster figures** (:func:`cluster_of`). ``resources.gpu_type`` picks the vendor figures below;
``gpu_memory_gb``, ``gpu_peak_tflops``, ``intra_node_bandwidth_gbps``, ``inter_node_bandwidth_gbps``
give them one by one (bandwidths may override a type's: fabrics differ). ``gpu_type: cpu``, and
the default when no peak is given, is the simulated CPU cluster (``--simulate``, local processes:
gloo over loopback on one machine), whose ranks share the machine's cores: its figures
(:data:`CPU_FIGURES`) are measured by bench/cpu_calibrate.py, and its step time is
:mod:`service.spec.cost_cpu`'s (the machine's work summed over ranks, per-message latency, no
bubble) instead of the one below.

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

from service.spec.pipeline import bubble_fraction

GB = 1e9

# Vendor figures per accelerator (SXM parts): dense bf16 TFLOP/s (without sparsity), memory in GB,
# NVLink one direction (NVIDIA quotes both directions together: 600 / 900 / 900 / 1800 GB/s), and one
# InfiniBand NIC per GPU one direction (HDR 200 Gb/s = 25 GB/s; NDR 400 Gb/s = 50 GB/s).
# A100: A100 datasheet (312 TFLOPS bf16, 80 GB HBM2e, NVLink 600 GB/s); DGX A100: 8x HDR.
# H100: H100 datasheet (989 TFLOPS bf16 dense = 1,979 with sparsity / 2, 80 GB, NVLink 900 GB/s); DGX H100: 8x NDR.
# H200: H200 datasheet (989 TFLOPS bf16 dense, 141 GB HBM3e, NVLink 900 GB/s); 8x NDR.
# B200: HGX B200 datasheet (2.25 PFLOPS bf16 dense = 4.5 sparse / 2, 180 GB HBM3e, NVLink 5 1,800 GB/s); DGX B200: 8x NDR.
GPU_FIGURES: dict[str, dict[str, float]] = {
    "A100": {"memory_gb": 80, "peak_tflops": 312, "intra_gbps": 300, "inter_gbps": 25},
    "H100": {"memory_gb": 80, "peak_tflops": 989, "intra_gbps": 450, "inter_gbps": 50},
    "H200": {"memory_gb": 141, "peak_tflops": 989, "intra_gbps": 450, "inter_gbps": 50},
    "B200": {"memory_gb": 180, "peak_tflops": 2250, "intra_gbps": 900, "inter_gbps": 50},
}
RAY_ACCELERATORS = {"A100": "A100", "A100-80G": "A100", "H100": "H100", "H200": "H200", "B200": "B200"}
"""Ray's ``accelerator_type`` labels (ray.util.accelerators) of the accelerators :data:`GPU_FIGURES`
holds, to their ``gpu_type`` (an A100 of 40 GB is not among them: its memory is not the A100's 80)."""


def gpu_type_of(accelerators) -> str | None:
    """The ``gpu_type`` of GPU nodes whose Ray labels are ``accelerators``: their common type when
    every node reports the same one :data:`GPU_FIGURES` knows; None for none, an unknown or a mixed
    cluster (the spec's own figures, or the simulated CPU cluster's, apply then)."""
    kinds = {RAY_ACCELERATORS.get(a) if a else None for a in accelerators}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


SIMULATED_CPU = {"memory_gb": 16, "peak_tflops": 0.1, "intra_gbps": 2, "inter_gbps": 1}
"""Figures a cluster described by ``gpu_peak_tflops`` without a type falls back on (memory, bandwidths)."""
# The simulated CPU cluster (``gpu_type: cpu``, and the default): ranks are single-threaded
# processes sharing one machine's cores (:mod:`service.spec.cost_cpu`). Measured on the 2-core dev
# VM by bench/cpu_calibrate.py with 8 ranks (the 2 x 4 simulated cluster): the machine's fp32 GEMM
# rate over all cores (peak_tflops: an achieved rate, no EFFICIENCY applied), gloo's loopback
# throughput of all ranks together (intra/inter: one machine), the wait per message of a collective
# per group size with every rank busy (hop_latency_s), the machine's memory bandwidth (a large add).
# Medians of 4-5 calibrations at load 9-18 (README "Auto layout" gives the spread); 16 GB assumed.
# process_mb: what a rank process adds whatever the model (a negligible one, measured in every layout
# of bench/auto_layout_bench.py at 35.7-37.6 MB): the modules it imports as it builds and steps
# (numpy.random alone ~14 MB), its process groups, autograd's and OpenMP's threads, first-use buffers.
CPU_FIGURES = {"memory_gb": 16, "peak_tflops": 0.1, "intra_gbps": 4.2, "inter_gbps": 4.2, "cores": 2,
               "hop_latency_s": {2: 0.00016, 4: 0.0009, 8: 0.002}, "memory_gbps": 13.6, "process_mb": 37}

EFFICIENCY = 0.5
"""Achieved / peak FLOP/s of the GEMMs (model FLOPs utilisation before communication and bubble)."""

MEMORY_MARGIN = 0.85
"""A layout fits when its peak bytes are at most this share of the accelerator's memory (the rest:
CUDA context, NCCL buffers, allocator fragmentation, temporaries)."""


@dataclass(frozen=True)
class Cluster:
    """The figures the cost model uses, in bytes and seconds."""

    name: str
    memory_bytes: float
    peak_flops: float
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    cores: int = 0
    """0: each rank has its own accelerator; n: the ranks share n cores (:mod:`service.spec.cost_cpu`;
    then peak and bandwidths are the whole machine's)."""
    hop_latency_s: tuple[tuple[int, float], ...] = ()
    """Shared cores: (group size, seconds per message of a collective in a group of that size: a
    receiver woken and scheduled), per measured group size."""
    memory_bytes_per_s: float = 0.0
    """Shared cores: the machine's memory bandwidth (the optimizer's update streams through it)."""
    process_bytes: float = 0.0
    """Shared cores: what a rank process holds whatever the model (counted in its peak). On an
    accelerator that is the CUDA context and NCCL's buffers, outside the device budget the peak is
    checked against (:data:`MEMORY_MARGIN` leaves room for them): 0."""

    def as_dict(self) -> dict:
        out = {"name": self.name, "memory_gb": self.memory_bytes / GB, "peak_tflops": self.peak_flops / 1e12,
               "intra_node_bandwidth_gbps": self.intra_bytes_per_s / GB,
               "inter_node_bandwidth_gbps": self.inter_bytes_per_s / GB}
        if self.cores:
            out.update(shared_cores=self.cores, hop_latency_s={str(g): t for g, t in self.hop_latency_s},
                       memory_bandwidth_gbps=self.memory_bytes_per_s / GB, process_mb=self.process_bytes / 2**20)
        return out


def cluster_of(resources) -> Cluster:
    """The cluster figures of a spec's ``resources`` section (validated: a type excludes memory and peak).
    ``gpu_type: cpu``, or no type and no ``gpu_peak_tflops``, is the simulated CPU cluster (shared cores)."""
    shared = resources.gpu_type == "cpu" or (resources.gpu_type is None and resources.gpu_peak_tflops is None)
    if shared:
        return _shared_cluster(resources)
    base = GPU_FIGURES[resources.gpu_type] if resources.gpu_type else SIMULATED_CPU
    name = resources.gpu_type or "simulated-cpu"
    given = {"memory_gb": resources.gpu_memory_gb, "peak_tflops": resources.gpu_peak_tflops,
             "intra_gbps": resources.intra_node_bandwidth_gbps, "inter_gbps": resources.inter_node_bandwidth_gbps}
    f = {k: (v if v is not None else base[k]) for k, v in given.items()}
    if any(v is not None for v in given.values()):
        name += " (as given)" if not resources.gpu_type else " (bandwidth as given)"
    return Cluster(name, f["memory_gb"] * GB, f["peak_tflops"] * 1e12, f["intra_gbps"] * GB, f["inter_gbps"] * GB)


BUCKET_ELEMENTS = 1_000_000
"""The trainer's gradient bucket (``workers.parallel.data.DEFAULT_BUCKET_SIZE``, elements)."""
SCATTERS_IN_FLIGHT = 2
"""Reduce-scatters in flight at most (``workers.parallel.grad_buffer.MAX_SCATTERS_IN_FLIGHT``)."""


def _shared_cluster(resources) -> Cluster:
    """The simulated CPU cluster's figures (:data:`CPU_FIGURES`), memory and bandwidths as given."""
    f = CPU_FIGURES
    given = {"memory_gb": resources.gpu_memory_gb, "intra_gbps": resources.intra_node_bandwidth_gbps,
             "inter_gbps": resources.inter_node_bandwidth_gbps}
    v = {k: (x if x is not None else f[k]) for k, x in given.items()}
    name = "simulated-cpu" + (" (as given)" if any(x is not None for x in given.values()) else "")
    return Cluster(name, v["memory_gb"] * GB, f["peak_tflops"] * 1e12, v["intra_gbps"] * GB, v["inter_gbps"] * GB,
                   cores=f["cores"], hop_latency_s=tuple(sorted(f["hop_latency_s"].items())),
                   memory_bytes_per_s=f["memory_gbps"] * GB, process_bytes=f["process_mb"] * 2**20)


def state_bytes(dense: float, expert: float, dense_shards: int, expert_shards: int, *, mixed: bool,
                distributed: bool) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state of one rank holding ``dense`` and ``expert``
    parameters, whose optimizer state the distributed optimizer shards ``dense_shards`` /
    ``expert_shards`` ways: the tensors :mod:`workers.parallel.optimizer` allocates.

    * weights: the model params (fp32 4, bf16/fp16 2 bytes); the replicated optimizer's flat
      main buffer *is* them in fp32 (the params are views of it);
    * gradients: the fp32 flat gradient buffer (4; the distributed optimizer reduce-scatters
      into it in place, as Megatron);
    * optimizer: the two fp32 moments (8), plus the fp32 main params where they are not the
      model's (bf16/fp16: 4); the distributed optimizer keeps them for its shard only (12 / n;
      fp32 8 / n: its main params are its slices of the model's flat param buffer);
    * scratch (distributed only): gloo's staging of the in-place param all-gather (one bucket in
      the params' dtype) and of each reduce-scatter in flight (:data:`SCATTERS_IN_FLIGHT` fp32
      buckets).
    """
    params = dense + expert
    weight = 2 if mixed else 4
    shard = dense / dense_shards + expert / expert_shards
    grad = 4 * params
    if distributed:
        optimizer = (12 if mixed else 8) * shard
        bucket = min(BUCKET_ELEMENTS, params)
        scratch = bucket * weight + SCATTERS_IN_FLIGHT * bucket * 4
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
