"""Step time on a shared-cores cluster: the simulated CPU cluster, whose ranks are processes that
share one machine's cores (gloo over loopback). Pure, no torch.

On accelerators (:func:`service.spec.cost.step_time`) each rank has its own device: a step lasts
as long as the slowest rank's work, a pipeline bubble leaves devices idle, and gradient traffic
hides behind backward. With ``world`` single-threaded ranks on ``cores`` cores none of that
holds: while one rank waits (a bubble, a collective) another rank's work runs on the core, and
moving bytes is itself work of the same cores. So a step costs the machine's work, summed over
ranks, at the machine's rate, plus the latency of the collective calls each rank makes one after
the other:

* **compute**: Megatron's FLOPs of the whole batch (all ranks together; full recompute adds one
  forward) over ``min(world, cores) / cores`` of the machine's GEMM rate (a rank runs one thread,
  so fewer ranks than cores leave cores idle). The rate is a measured one (a GEMM of the size of
  the model's), not a datasheet peak, so :data:`~service.spec.cost.EFFICIENCY` does not apply. TP and CP split the FLOPs without repeating them, so the sum does not depend on
  the layout;
* **bytes**: every byte any rank sends (the plan's traffic, all ranks summed) at the machine's
  loopback throughput (the kernel copies it through memory, on the same cores; the simulated
  cluster's "nodes" are one machine, so both bandwidth figures are that throughput unless given);
* **latency**: each collective is a chain of messages, each waiting for its receiver to be woken
  and scheduled on the shared cores; per rank and iteration the chain lengths add up (the rank
  cannot go on before its collective ends): TP 8 (tp-1) per layer and microbatch (with SP 4
  all-gathers / reduce-scatters forward and 4 backward of tp-1 steps; without, 2 + 2 all-reduces
  of 2 (tp-1)) plus 4 all-reduces of 2 (tp-1) per microbatch for the vocabulary-parallel
  embedding and cross-entropy; CP 2 (cp-1) per layer and microbatch (the K/V ring forward, K/V
  and their gradients backward); EP 4 all-to-alls of ep-1 per layer and microbatch; PP 2 per
  microbatch and model chunk (activation in, gradient in); DP 2 (n-1) per gradient bucket (n =
  dp x cp; reduce-scatter + all-gather with the distributed optimizer, the same steps). Each
  message costs the cluster's ``hop_latency_s`` for a group of that size (PP: a pair), measured
  with every rank of the machine busy: a message waits for its receiver to get a core, and the
  longer the chain of ranks, the longer the wait (on the 2-core VM about 0.1 ms in a pair,
  1-1.5 ms in a ring of 4 or 8);
* **optimizer**: the Adam update streams each rank's weights, gradients and moments through
  memory once (read and written): the state bytes of all ranks, twice, at the machine's memory
  bandwidth. DP replicas repeat it, the distributed optimizer does not;
* **no bubble**: an idle pipeline stage's core runs another rank's work. (With fewer ranks per
  stage than cores the first and last microbatch slots leave a core idle; not counted.)

Not modelled: GEMM efficiency by shape (small TP shards run below the calibrated rate), the
replicated elementwise work of TP without SP, the CPU time of Python per operation.
"""

from __future__ import annotations

from service.spec.cluster_figures import Cluster
from service.spec.cost import grad_bytes, megatron_flops, state_bytes

DEFAULT_BUCKET_ELEMENTS = 1_000_000
"""The trainer's gradient bucket (``workers.parallel.data.DEFAULT_BUCKET_SIZE``; not imported: no torch here)."""


def collective_hops(s, *, tp: int, cp: int, ep: int, pp: int, vpp: int | None, dp_cp: int,
                    num_microbatches: int, dense_parameters: float) -> dict[str, tuple[float, int]]:
    """Messages one rank waits for in one iteration and the size of the group they pass in, per
    parallel kind (module docstring): ``{kind: (messages, group_size)}``."""
    m, layers = num_microbatches, s.layers // pp  # TP: 8 (tp-1) per layer with or without SP
    buckets = -(-dense_parameters // DEFAULT_BUCKET_ELEMENTS)
    return {"tp": (m * (layers * 8 + 4 * 2) * (tp - 1), tp),
            "cp": (m * layers * 2 * (cp - 1), cp),
            "ep": (m * layers * 4 * (ep - 1) if s.experts else 0, ep),
            "pp": (m * 2 * (vpp or 1) if pp > 1 else 0, 2),
            "dp": (buckets * 2 * (dp_cp - 1), dp_cp)}


def hop_latency(cluster: Cluster, group_size: int) -> float:
    """Seconds per message of a collective among ``group_size`` ranks: the cluster's figure for the
    smallest measured group at least that large (the largest measured beyond them); 0 for one rank."""
    if group_size <= 1 or not cluster.hop_latency_s:
        return 0.0
    for g, seconds in sorted(cluster.hop_latency_s):
        if g >= group_size:
            return seconds
    return sorted(cluster.hop_latency_s)[-1][1]


def shared_step_time(s, *, world: int, global_batch_size: int, recompute: str | None,
                     rank_bytes: dict[str, dict[int, tuple[float, float]]], scale: dict[str, float],
                     hops: dict[str, tuple[float, int]], state_bytes_all_ranks: float,
                     cluster: Cluster) -> dict[str, float]:
    """Predicted seconds of one iteration on a shared-cores cluster, by part (module docstring).
    ``rank_bytes``: the plan's traffic per kind and rank; ``scale``: per kind, the element-size
    factor of the plan's fp32 count; ``hops``: :func:`collective_hops`."""
    rate = cluster.peak_flops * min(world, cluster.cores) / cluster.cores  # an achieved GEMM rate already
    compute = megatron_flops(s, global_batch_size) / rate
    recompute_s = megatron_flops(s, global_batch_size, recompute=recompute) / rate - compute
    parts, latency = {}, {}
    for kind in ("tp", "cp", "ep", "pp", "dp"):
        seconds = sum(a / cluster.intra_bytes_per_s + b / cluster.inter_bytes_per_s  # in-node, cross-node
                      for a, b in rank_bytes.get(kind, {}).values()) * scale.get(kind, 1.0)
        messages, group = hops.get(kind, (0, 1))
        latency[kind] = messages * hop_latency(cluster, group)
        parts[kind] = seconds + latency[kind]
    optimizer = 2 * state_bytes_all_ranks / cluster.memory_bytes_per_s
    total = compute + recompute_s + sum(parts.values()) + optimizer
    return {"compute": compute, "recompute": recompute_s, **{k: parts[k] for k in ("tp", "cp", "ep", "pp")},
            "bubble": 0.0, "dp": parts["dp"], "dp_exposed": parts["dp"], "optimizer": optimizer,
            "latency": sum(latency.values()), "total": total}


def spec_step_time(s, spec, grid, rank_bytes, cluster: Cluster, stage_ranks: list[dict], num_microbatches: int,
                   act_scale: float, mixed: bool) -> dict[str, float]:
    """:func:`shared_step_time` of a concrete spec (:func:`service.spec.plan.estimate`'s inputs):
    ``stage_ranks`` the parameters of one rank per pipeline stage (the others repeat them),
    ``rank_bytes`` the plan's traffic per kind and rank."""
    p = spec.parallel
    per_stage = grid.world_size // grid.pp
    state_all = per_stage * sum(
        state_bytes(r["dense"], r["expert"], grid.dp * grid.cp, grid.expert_dp, mixed=mixed,
                    distributed=p.use_distributed_optimizer,
                    grad_bytes=grad_bytes(spec.training))["total"] for r in stage_ranks)
    hops = collective_hops(s, tp=grid.tp, cp=grid.cp, ep=grid.ep, pp=grid.pp, vpp=grid.vpp, dp_cp=grid.dp * grid.cp,
                           num_microbatches=num_microbatches,
                           dense_parameters=max(r["dense"] for r in stage_ranks))
    return shared_step_time(s, world=grid.world_size, global_batch_size=spec.training.global_batch_size,
                            recompute=spec.model.recompute_granularity, rank_bytes=rank_bytes,
                            scale={k: act_scale for k in ("tp", "cp", "ep", "pp")}, hops=hops,
                            state_bytes_all_ranks=state_all, cluster=cluster)
