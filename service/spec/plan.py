"""What a job would need, from the pure rank math: grid, placement, memory and traffic. Runs nothing.

Used by ``POST /api/v1/plan`` and ``raytron plan SPEC``. No torch import: parameter counts come
from the model's shapes (:mod:`service.spec.shapes`).

Memory per rank (:func:`memory`): weights, gradients and optimizer state in the spec's precision,
without and with the distributed optimizer, by the cost model's one accounting
(:func:`service.spec.cost.state_bytes`: fp32 ``4 + 4 + 8`` bytes per parameter, ``4 + 4 + 8/n``
sharded n ways; bf16 Megatron's ``2 + 4 + 12``, ``6 + 12/n``). :func:`estimate` adds the most
loaded rank's activations and the predicted step time on the spec's cluster figures
(``resources.gpu_type`` ...), from the traffic counted here.

Traffic is the bytes *sent* per iteration, summed over all ranks, modelled as ring collectives
(an all-reduce of M bytes over n ranks: each rank sends ``2(n-1)/n x M``; all-gather or
reduce-scatter: ``(n-1)/n x M``) and point-to-point sends. Each ring hop (consecutive ranks of a
group, as Megatron lists them) is in-node when both ranks share a node of the placement plan.
Per microbatch and layer: TP 4 all-reduce-equivalents of the activation (2 forward, 2 backward;
with SP the all-gather/reduce-scatter pairs move the same bytes); CP the K/V chunks around the
ring (cp-1 sends forward, twice that backward); EP 4 all-to-alls of the routed tokens (dispatch
and combine, forward and backward); PP one activation per stage boundary forward and one
gradient backward; DP one all-reduce (or reduce-scatter + all-gather) of the gradients.
"""

from __future__ import annotations

from service.spec import cost
from service.spec.cluster_figures import cluster_of
from service.spec.cost_cpu import spec_step_time
from service.spec.fp8 import fp8_seconds
from service.spec.placement import plan_placement
from service.spec.shapes import Shapes, model_parameters, rank_parameters
from workers.grid import ParallelGrid
from workers.parallel.pipeline import place

BYTES = 4  # fp32 weights, gradients, activations


def memory(s: Shapes, grid: ParallelGrid, *, mixed: bool = False, grad_bytes: int = BYTES) -> list[dict]:
    """Per rank: parameters and bytes of weights, gradients and optimizer state, without and with
    the distributed optimizer, in bf16/fp16 (``mixed``) or fp32: :func:`service.spec.cost.state_bytes`,
    the accounting the plan's ``cost`` uses too."""
    out = []
    for rank in range(grid.world_size):
        p = rank_parameters(s, grid, rank)
        rep, dist = (cost.state_bytes(p["dense"], p["expert"], grid.dp * grid.cp, grid.expert_dp, mixed=mixed,
                                      grad_bytes=grad_bytes,
                                      distributed=d) for d in (False, True))
        out.append({"rank": rank, "parameters": p["dense"] + p["expert"], "dense_parameters": p["dense"],
                    "expert_parameters": p["expert"], "param_bytes": round(rep["weights"]),
                    "grad_bytes": round(rep["gradients"]), "optimizer_bytes": round(rep["optimizer"]),
                    "optimizer_bytes_distributed": round(dist["optimizer"]), "total_bytes": round(rep["total"]),
                    "total_bytes_distributed": round(dist["total"])})
    return out


class _Traffic:
    def __init__(self, node_of: list[int]):
        self.node_of = node_of
        self.totals: dict[str, dict[str, float]] = {}
        self.by_rank: dict[str, dict[int, tuple[float, float]]] = {}  # kind -> rank -> (in-node, cross-node)

    def send(self, kind: str, src: int, dst: int, nbytes: float) -> None:
        where = "in_node" if self.node_of[src] == self.node_of[dst] else "cross_node"
        bucket = self.totals.setdefault(kind, {"in_node": 0.0, "cross_node": 0.0})
        bucket[where] += nbytes
        mine = self.by_rank.setdefault(kind, {}).get(src, (0.0, 0.0))
        self.by_rank[kind][src] = (mine[0] + nbytes, mine[1]) if where == "in_node" else (mine[0], mine[1] + nbytes)

    def ring(self, kind: str, group: list[int], per_rank_bytes: float) -> None:
        """A ring collective in which each rank sends ``per_rank_bytes`` to its successor."""
        n = len(group)
        if n > 1:
            for i, r in enumerate(group):
                self.send(kind, r, group[(i + 1) % n], per_rank_bytes)

    def all_to_all(self, kind: str, group: list[int], per_rank_bytes: float) -> None:
        """Each rank sends ``per_rank_bytes`` spread evenly over the group (its own share stays)."""
        n = len(group)
        for src in group:
            for dst in group:
                if src != dst:
                    self.send(kind, src, dst, per_rank_bytes / n)


def traffic(s: Shapes, spec, grid: ParallelGrid, node_of: list[int]) -> dict[str, dict[str, int]]:
    """Bytes sent per iteration by each parallel dimension, in-node vs cross-node (see module docstring)."""
    return {k: {w: round(v) for w, v in d.items()} for k, d in count_traffic(s, spec, grid, node_of).totals.items()}


def count_traffic(s: Shapes, spec, grid: ParallelGrid, node_of: list[int]) -> _Traffic:
    t, p = spec.training, spec.parallel
    mbs = t.global_batch_size // (t.micro_batch_size * grid.dp)  # microbatches per iteration per dp rank
    layers = s.layers // grid.pp
    tokens = s.seq // grid.cp * t.micro_batch_size  # per microbatch on one rank (before SP)
    act = tokens * s.hidden * BYTES
    tr = _Traffic(node_of)
    for kind in ("tp", "cp", "ep", "dp", "pp"):
        tr.totals[kind] = {"in_node": 0.0, "cross_node": 0.0}
    n = grid.tp
    for g in grid.groups("tp"):
        tr.ring("tp", g, mbs * layers * 4 * 2 * (n - 1) / n * act)
    if grid.cp > 1 and p.cp_comm_type in ("a2a", "a2a+p2p"):
        # all-to-all (inside each a2a group): q, k, v and the output of every token cross once each way
        # ((a-1)/a of each leaves the rank); K/V heads that do not divide by a travel repeated to one per
        # query head. a2a+p2p: then the ring across the a2a groups with their K/V, (p2p-1) x 3 blocks.
        a2a = p.hierarchical_context_parallel_sizes[0] if p.cp_comm_type == "a2a+p2p" else grid.cp
        head = s.mla.ring_width // 2 if s.mla else s.head_dim
        kv_heads = s.heads if s.mla or (s.groups // grid.tp) % a2a else s.groups
        width = (2 * s.heads + 2 * kv_heads) * head
        exchanged = mbs * layers * 2 * tokens * width * BYTES // grid.tp
        kv = tokens * 2 * kv_heads * head * BYTES // grid.tp  # a ring member's block: a2a x tokens x kv/a2a
        for g in grid.groups("cp"):
            for i in range(0, grid.cp, a2a):
                tr.all_to_all("cp", g[i:i + a2a], exchanged)
            if grid.cp > a2a:  # a2a+p2p: the rings across the a2a groups
                for j in range(a2a):
                    tr.ring("cp", g[j::a2a], mbs * layers * 3 * (grid.cp // a2a - 1) * kv)
    elif grid.cp > 1:
        width = s.heads * s.mla.ring_width if s.mla else 2 * s.groups * s.head_dim
        kv = tokens * width * BYTES // grid.tp
        for g in grid.groups("cp"):
            # p2p ring attention: each K/V chunk visits every other rank; backward sends K/V and dK/dV
            tr.ring("cp", g, mbs * layers * 3 * (grid.cp - 1) * kv)
    if s.experts and grid.ep > 1:
        routed = tokens // (grid.tp if p.sequence_parallel else 1) * s.topk * s.hidden * BYTES
        for g in grid.groups("ep", expert=True):
            tr.all_to_all("ep", g, mbs * layers * 4 * routed)
    if grid.pp > 1:
        chunks = grid.pp * (p.virtual_pipeline_model_parallel_size or 1)
        boundary = mbs * act // (grid.tp if p.sequence_parallel else 1)
        for g in grid.groups("pp"):
            for k in range(chunks - 1):  # virtual stage k lives on pp rank k % pp (in the V: place)
                src, dst = (g[place(v, grid.pp, s.v_shape)[0]] for v in (k, k + 1))
                if src == dst:
                    continue  # the V's turn: a hand-over inside one rank
                tr.send("pp", src, dst, boundary)  # activations forward
                tr.send("pp", dst, src, boundary)  # their gradients backward
    for g in grid.groups("dp-cp"):
        dense = rank_parameters(s, grid, g[0])["dense"] * cost.grad_bytes(t)
        tr.ring("dp", g, 2 * (len(g) - 1) / len(g) * dense)
    if s.experts:
        for g in grid.groups("dp", expert=True):
            expert = rank_parameters(s, grid, g[0])["expert"] * cost.grad_bytes(t)
            tr.ring("dp", g, 2 * (len(g) - 1) / len(g) * expert)
    return tr


def estimate(spec, grid: ParallelGrid, node_of: list[int], tr: _Traffic | None = None) -> dict:
    """The cost model (:mod:`service.spec.cost`) of a concrete spec: the most loaded rank's bytes
    (state and activations) and the predicted step time by part, on the spec's cluster figures.
    ``tr``: the spec's traffic when already counted (it does not depend on the optimizer or recompute)."""
    s, t, p, m = Shapes.of(spec), spec.training, spec.parallel, spec.model
    cluster = cluster_of(spec.resources)
    mixed = t.bf16 or t.fp16
    ranks = [rank_parameters(s, grid, r) for r in grid.groups("pp")[0]]  # one rank per stage: the rest repeat
    busiest = max(ranks, key=lambda r: r["dense"] + r["expert"])
    state = cost.state_bytes(busiest["dense"], busiest["expert"], grid.dp * grid.cp, grid.expert_dp, mixed=mixed,
                             distributed=p.use_distributed_optimizer, grad_bytes=cost.grad_bytes(t))
    num_microbatches = t.global_batch_size // (t.micro_batch_size * grid.dp)
    act = cost.activation_bytes(s, tp=grid.tp, pp=grid.pp, cp=grid.cp, vpp=grid.vpp, sp=p.sequence_parallel,
                                micro_batch_size=t.micro_batch_size, num_microbatches=num_microbatches,
                                recompute=m.recompute_granularity, recompute_method=m.recompute_method,
                                recompute_num_layers=m.recompute_num_layers, element_bytes=2 if mixed else 4,
                                schedule=p.pipeline_schedule)
    tr = tr or count_traffic(s, spec, grid, node_of)
    act_scale = (2 if mixed else 4) / BYTES  # the traffic model counts fp32; DP gradients as grad_bytes
    if cluster.cores:  # ranks sharing a machine's cores: the machine's work (service/spec/cost_cpu.py)
        step = spec_step_time(s, spec, grid, tr.by_rank, cluster, ranks, num_microbatches, act_scale, mixed)
    else:
        comm = cost.comm_seconds(tr.by_rank, cluster, {k: act_scale for k in ("tp", "cp", "ep", "pp")})
        step = cost.step_time(s, world=grid.world_size, pp=grid.pp, vpp=grid.vpp,
                              global_batch_size=t.global_batch_size, num_microbatches=num_microbatches,
                              recompute=m.recompute_granularity, comm=comm, cluster=cluster,
                              distributed=p.use_distributed_optimizer, schedule=p.pipeline_schedule)
        if t.fp8:  # the FP8 linears' GEMMs as the code runs them (service/spec/fp8.py)
            extra = fp8_seconds(s, t, spec.resources.gpu_type, cluster.peak_flops, cost.EFFICIENCY, grid.world_size)
            step = {**step, "fp8": extra, "total": step["total"] + extra}
    peak = state["total"] + act["total"] + cluster.process_bytes
    cross = sum(d["cross_node"] for d in tr.totals.values())
    return {"cluster": cluster.as_dict(), "state_bytes": state, "activation_bytes": act,
            "process_bytes": cluster.process_bytes, "peak_bytes_per_rank": peak, "fits": peak <= cost.MEMORY_MARGIN * cluster.memory_bytes,
            "memory_margin": cost.MEMORY_MARGIN, "num_microbatches": num_microbatches,
            "cross_node_bytes": cross, "step_seconds": step, "predicted_step_s": step["total"]}


def plan_job(spec) -> dict:
    """The whole plan of a valid spec: grid sizes, placement, memory per rank, traffic per iteration,
    and the cost model's estimate."""
    world = spec.world_size
    grid = ParallelGrid.from_config(spec.parallel, world)
    placement = plan_placement(grid, spec.resources.gpus_per_node, spec.resources.num_nodes)
    node_of = [pl.node for pl in placement]
    s = Shapes.of(spec)
    mem = memory(s, grid, mixed=spec.training.bf16 or spec.training.fp16, grad_bytes=cost.grad_bytes(spec.training))
    ranks = []
    for pl in placement:
        c = grid.coords(pl.rank)
        ranks.append({"rank": pl.rank, "node": pl.node, "local": pl.local,
                      **{k: c[k] for k in ("tp", "cp", "dp", "pp", "ep", "etp", "expert_dp")}})
    return {"name": spec.name, "world_size": world, "num_nodes": spec.resources.num_nodes,
            "gpus_per_node": spec.resources.gpus_per_node, "sizes": grid.sizes(), "order": grid.order,
            "model_parameters": model_parameters(s),
            "placement": ranks, "memory": mem, "traffic": traffic(s, spec, grid, node_of),
            "cost": estimate(spec, grid, node_of)}
