"""Bytes each rank sends per iteration, per group, next to the analytic minimum (run by hand).

    .venv/bin/python -m bench.comm_bench [--only tp2,cp2-p2p] [--per-rank]

For each layout a small model trains two iterations on ``world <= 8`` local gloo ranks; the
counters of :mod:`workers.parallel.comm` are reset after the first, so the numbers are one
steady iteration. Every collective is attributed to the *traffic* that issued it (the calling
module, and for gradients the param group), because one communicator often serves several
group kinds (with tp2 on two ranks, "tp", "tp-dp-cp", "etp", ... are one rank set, hence one
handle and one label). Rows show the traffic, the comm label its group carries, the bytes per
rank (mean over ranks), the minimum below and ``ratio = measured / minimum`` (worst rank).

Derivation of the minimum (per rank, one iteration)
===================================================

Notation: ``s = seq_length / cp`` tokens per CP rank, ``b`` micro batch, ``h`` hidden, ``d``
head dim, ``g = num_query_groups / tp`` local kv heads, ``V`` vocab padded to a multiple of tp,
``m = global_batch / (micro_batch * dp)`` microbatches, ``L`` decoder layers on this rank,
4-byte floats, ``A = s*b*h*4`` one activation. Ring formulas (comm.py):
``AR(n, B) = 2 (n-1)/n B``, all-gather ``(n-1)/n x output``, reduce-scatter
``(n-1)/n x input``, all-to-all and p2p: the bytes that leave the rank.

* **tp** (tensor parallel activations). A column->row region needs its input complete on every
  rank and its partial output summed: per dense layer per microbatch 2 forward all-reduces
  (after proj and after down) and 2 backward all-reduces (the input grads of qkv and gate_up),
  ``4 AR(tp, A)``; a MoE layer (its tokens are SP-sharded, no TP inside) only attention's
  ``2 AR(tp, A)``. With SP each all-reduce becomes a reduce-scatter + all-gather of the same
  volume (``2 x (tp-1)/tp A``), and each column-parallel layer (qkv, gate_up, the output
  layer) gathers its input shard once more in backward, ``(tp-1)/tp A`` each: it saves only
  the shard for backward (Megatron's trade of bytes for activation memory). The vocab-parallel embedding adds
  one AR of its partial lookup (SP: RS forward, AG backward), the output layer one AR of its
  input grad (SP: AG forward, RS backward). Cross-entropy needs, per token, the log-sum-exp
  over the vocab shards and the target logit: 2 floats, ``AR(tp, 2 s b 4)`` (the
  implementation also all-reduces the max for numerical stability, a third float per token,
  ~0.1% here; a log-add-exp reduction would avoid it).
* **sp grads** (``tp-dp-cp``): weights applied to sequence shards (RMSNorm weights, MoE routers
  with SP) have grads partial over tp and dp-cp: ``AR(tp dp cp, P_sp 4)``.
* **dp grads** (``dp-cp``): every other non-expert local param once, ``AR(dp cp, P_dense 4)``;
  with the distributed optimizer a reduce-scatter of the grads plus an all-gather of the params,
  ``2 (n-1)/n P 4``, the same volume (buckets pad to a multiple of n: a few elements).
* **expert grads** (``expert-dp``): ``AR(expert_dp, P_expert 4)``.
* **pp**: per microbatch one activation forward and one gradient backward across every
  virtual-stage boundary; the rank sends one ``A_pp = (s / tp if SP) b h 4`` for each of its
  virtual stages that is not the last (forward) and each that is not the first (backward).
* **cp**: only attention mixes tokens. The K/V block of a rank is ``K = s b g 2d 4``. Ring
  (``p2p``): forward, each block visits the cp-1 other ranks (cp-1 sends per rank); backward
  recomputes from the saved local q,k,v (FlashAttention's recipe, as Megatron/TE: K/V are not
  saved from the forward ring) so K/V circulate again (cp-1) and each block's dK/dV, partial on
  the cp-1 ranks that used it, must be summed back to its owner: a chain of cp-1 hops
  (reduce-scatter bound ``(cp-1)/cp x cp K``). Total ``3 (cp-1) K`` per layer per microbatch.
  ``all_gather``: AG of K/V forward + RS of dK/dV backward, ``2 (cp-1) K``.
* **ep**: each token choice routed to an expert on another EP rank must go there and its output
  come back, forward and backward: ``2 (sent + received) h 4`` with ``sent`` / ``received``
  the rank's remote choices counted from the actual routing (a forward hook on the routers),
  plus the per-expert counts (``(E - E/ep)`` int64 per MoE layer per microbatch). This is the
  per-choice minimum of Megatron's all-to-all dispatcher; deduplicating the k choices of one
  token that go to the same rank (DeepEP style) would be lower still (see the report line).
* **etp**: expert tensor parallelism gathers the EP-received rows of the ETP group (forward),
  reduce-scatters the partial outputs (forward) and the adjoints backward:
  ``4 (etp-1)/etp x rows_group h 4`` plus the counts all-gather ``(etp-1) E 8``.
* **loss**: the reported loss is one float64 all-reduced over dp-cp (last stage) and pp; a MoE
  model also all-reduces its reported aux loss (one float64) over the world.
* **grad-norm**: the global gradient norm (clipping, reported every step) is one float64 sum
  of squares all-reduced over the world (Megatron: one all-reduce over its grad-stats group).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field


from service.spec.spec import parse_spec, to_job_config  # noqa: E402
from workers.config import JobConfig  # noqa: E402
from workers.grid import ParallelGrid  # noqa: E402
from workers.parallel.pipeline import partition_layers  # noqa: E402

FLOAT = 4  # fp32 activations, grads and params
INDEX = 8  # int64 per-expert counts
LOSS = 8  # the float64 loss scalar

# Which traffic a collective belongs to, by the module that issued it.
_SOURCES = {
    "workers.parallel.tensor": "tp",
    "workers.parallel.cross_entropy": "tp",
    "workers.model.mla": "tp",
    "workers.parallel.sequence": "tp",
    "workers.parallel.context": "cp",
    "workers.parallel.context_ring": "cp",
    "workers.parallel.context_a2a": "cp",
    "workers.parallel.pipeline_exec": "pp",
    "workers.parallel.moe_dispatch": "moe",
    "workers.parallel.data": "grads",
    "workers.parallel.grad_buffer": "grads",
    "workers.parallel.param_gather": "grads",
    "workers.parallel.optimizer": "grads",
    "workers.train.trainer": "loss",
    "workers.train.reduce": "loss",
    "workers.parallel.clip": "grad-norm",
}
TRAFFIC = ("tp", "cp", "pp", "ep", "etp", "grads:dense", "grads:sp", "grads:expert", "loss:dp-cp", "loss:pp",
           "loss:world", "grad-norm")
# The ProcessGroups kind each traffic runs on (ProcessGroups.group(kind) is its handle).
GROUP_OF = {"tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep", "etp": "etp", "grads:dense": "dp_cp",
            "grads:sp": "tp_dp_cp", "grads:expert": "expert_dp", "loss:dp-cp": "dp_cp", "loss:pp": "pp",
            "loss:world": None, "grad-norm": None}


@dataclass(frozen=True)
class Layout:
    name: str
    parallel: dict
    moe: bool = False
    model: dict = field(default_factory=dict)


LAYOUTS = [
    Layout("tp2", {"tensor_model_parallel_size": 2}),
    Layout("tp2+sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    Layout("pp2", {"pipeline_model_parallel_size": 2}),
    Layout("pp2+vpp2", {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    Layout("dp2", {}),
    Layout("dp2+distopt", {"use_distributed_optimizer": True}),
    Layout("tp2xpp2xdp2+sp", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                              "sequence_parallel": True}),
    Layout("cp2-p2p", {"context_parallel_size": 2, "cp_comm_type": "p2p"}),
    Layout("cp2-allgather", {"context_parallel_size": 2, "cp_comm_type": "all_gather"}),
    Layout("cp2-a2a", {"context_parallel_size": 2, "cp_comm_type": "a2a"}),
    # the four ways at cp 4 side by side (a2a: the 2 K/V heads travel repeated to 4)
    Layout("cp4-p2p", {"context_parallel_size": 4, "cp_comm_type": "p2p"}),
    Layout("cp4-allgather", {"context_parallel_size": 4, "cp_comm_type": "all_gather"}),
    Layout("cp4-a2a", {"context_parallel_size": 4, "cp_comm_type": "a2a"}),
    Layout("cp4-a2a+p2p", {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                           "hierarchical_context_parallel_sizes": [2, 2]}),
    Layout("ep2-moe", {"expert_model_parallel_size": 2}, moe=True),
    Layout("tp2+sp+ep2-moe(etp2)", {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                    "expert_model_parallel_size": 2}, moe=True),
    Layout("tp2+sp+ep2-moe(etp1)", {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                    "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, moe=True),
]
WORLD = {"tp2": 2, "tp2+sp": 2, "pp2": 2, "pp2+vpp2": 2, "dp2": 2, "dp2+distopt": 2, "tp2xpp2xdp2+sp": 8,
         "cp2-p2p": 2, "cp2-allgather": 2, "cp2-a2a": 2, "cp4-p2p": 4, "cp4-allgather": 4, "cp4-a2a": 4,
         "cp4-a2a+p2p": 4, "ep2-moe": 2, "tp2+sp+ep2-moe(etp2)": 4, "tp2+sp+ep2-moe(etp1)": 4}

SMALL_MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
               "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 32}
SMALL_TRAINING = {"train_iters": 2, "global_batch_size": 8, "micro_batch_size": 2, "lr": 1e-3, "seed": 7}


def layout_spec(layout: Layout, world: int, *, model: dict | None = None, training: dict | None = None) -> dict:
    """The job spec of ``layout`` on ``world`` ranks (one node)."""
    moe = {"num_moe_experts": 4, "moe_router_topk": 2} if layout.moe else {}
    return {
        "name": "bench-" + re.sub(r"[^A-Za-z0-9_.-]", "-", layout.name),
        "model": {**SMALL_MODEL, **moe, **layout.model, **(model or {})},
        "parallel": dict(layout.parallel),
        "training": {**SMALL_TRAINING, **(training or {})},
        "resources": {"num_nodes": 1, "gpus_per_node": world},
    }


def layout_job(layout: Layout, world: int | None = None, **kw) -> JobConfig:
    return to_job_config(parse_spec(layout_spec(layout, world or WORLD[layout.name], **kw)))


# ----------------------------------------------------------------------------- the minimum


def all_reduce_bytes(n: int, nbytes: float) -> float:
    """Ring all-reduce: 2 (n-1)/n x bytes (0 for a group of one)."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def ratio(measured: float, minimum: float) -> float:
    """measured / minimum; 1 when both are 0, inf when only the minimum is 0."""
    if minimum <= 0:
        return 1.0 if measured <= 0 else math.inf
    return measured / minimum


def _padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def _experts_of(ep_index: int, num_experts: int, ep: int) -> range:
    per = num_experts // ep
    return range(ep_index * per, (ep_index + 1) * per)


def analytic_bytes(job: JobConfig, rank: int, routes: dict[int, list[int]] | None = None) -> dict[str, float]:
    """The minimum bytes ``rank`` sends in one iteration, per traffic (see the module docstring).

    Args:
        job: the job.
        rank: a global rank.
        routes: for MoE with ep or etp > 1, each global rank's number of token choices per
            expert during the iteration (summed over its MoE layers and microbatches).

    Returns:
        ``{traffic: bytes}`` for every name in :data:`TRAFFIC`.
    """
    m, p, t = job.model, job.parallel, job.training
    grid = ParallelGrid.from_config(p, job.world_size)
    tp, pp, cp, dp, ep, etp, edp = grid.tp, grid.pp, grid.cp, grid.dp, grid.ep, grid.etp, grid.expert_dp
    vpp = p.virtual_pipeline_model_parallel_size or 1
    sp = p.sequence_parallel and tp > 1
    nmb = t.global_batch_size // (t.micro_batch_size * dp)
    s, b, h, d = m.seq_length // cp, t.micro_batch_size, m.hidden_size, m.head_dim
    act = s * b * h * FLOAT
    stage = grid.coords(rank)["pp"]
    layers = sum(len(c) for c in partition_layers(m.num_layers, pp, p.virtual_pipeline_model_parallel_size)[stage])
    pre, post = stage == 0, stage == pp - 1
    out = dict.fromkeys(TRAFFIC, 0.0)

    # Tensor parallelism: 4 (dense) or 2 (MoE: attention only) all-reduce volumes per layer.
    # With SP, each column-parallel layer re-gathers its saved input shard in backward.
    regather = (tp - 1) / tp * act if sp else 0.0
    per_layer = (2 if m.is_moe else 4) * all_reduce_bytes(tp, act) + (1 if m.is_moe else 2) * regather
    per_mb = layers * per_layer + pre * all_reduce_bytes(tp, act)
    per_mb += post * (all_reduce_bytes(tp, act) + regather + all_reduce_bytes(tp, 2 * s * b * FLOAT))
    out["tp"] = nmb * per_mb

    # Pipeline: one tensor per virtual-stage boundary and direction.
    last = pp * vpp - 1
    sends = sum(int(v < last) + int(v > 0) for v in (c * pp + stage for c in range(vpp)))
    out["pp"] = nmb * sends * (s // (tp if sp else 1)) * b * h * FLOAT if pp > 1 else 0.0

    # Context parallelism: K/V blocks of the local kv heads (ring, all-gather); with a2a every
    # token's q, k, v and output once each way, (cp-1)/cp of them leaving the rank (K/V heads that do
    # not divide by cp travel repeated to one per query head).
    if cp > 1 and p.cp_comm_type in ("a2a", "a2a+p2p"):
        a2a = p.hierarchical_context_parallel_sizes[0] if p.cp_comm_type == "a2a+p2p" else cp
        heads = m.num_attention_heads // tp
        kv_heads = m.num_query_groups // tp if (m.num_query_groups // tp) % a2a == 0 else heads
        out["cp"] = nmb * layers * 2 * (a2a - 1) / a2a * s * b * (2 * heads + 2 * kv_heads) * d * FLOAT
        # a2a+p2p: the ring across the a2a groups, each member's block its group's tokens, its kv heads
        out["cp"] += nmb * layers * 3 * (cp // a2a - 1) * s * b * kv_heads * 2 * d * FLOAT
    elif cp > 1:
        kv_block = s * b * (m.num_query_groups // tp) * 2 * d * FLOAT
        blocks = 3 * (cp - 1) if p.cp_comm_type == "p2p" else 2 * (cp - 1)
        out["cp"] = nmb * layers * blocks * kv_block

    # Gradients (and the distributed optimizer's param all-gather) per param group.
    vocab = _padded_vocab(m.vocab_size, tp)
    heads, groups, f = m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    dense = layers * (groups * (heads // groups + 2) * d * h // tp + h * heads * d // tp)
    dense += (pre + post) * vocab * h // tp
    seq = layers * 2 * h + post * h
    expert = 0
    if m.is_moe:
        seq += layers * m.num_moe_experts * h  # routers
        expert = layers * 3 * (m.num_moe_experts // ep) * (f // etp) * h
    else:
        dense += layers * 3 * f * h // tp
    if not p.sequence_parallel:
        dense, seq = dense + seq, 0
    out["grads:dense"] = all_reduce_bytes(dp * cp, dense * FLOAT)
    out["grads:sp"] = all_reduce_bytes(tp * dp * cp, seq * FLOAT)
    out["grads:expert"] = all_reduce_bytes(edp, expert * FLOAT)
    out["loss:dp-cp"] = post * all_reduce_bytes(dp * cp, LOSS)
    out["loss:pp"] = all_reduce_bytes(pp, LOSS)
    out["loss:world"] = m.is_moe * all_reduce_bytes(job.world_size, LOSS)  # the reported MoE aux loss
    out["grad-norm"] = all_reduce_bytes(job.world_size, LOSS)  # the float64 sum of squares

    # Experts: the routed token rows (from the actual routing) and the per-expert counts.
    if m.is_moe and (ep > 1 or etp > 1):
        if routes is None:
            raise ValueError("analytic_bytes: a MoE layout with ep or etp > 1 needs the routes of every rank")
        num_e, calls = m.num_moe_experts, nmb * layers
        ep_groups = grid.groups("ep", expert=True)
        ep_group_of = {r: g for g in ep_groups for r in g}

        def received(q: int) -> int:  # rows rank q's experts get from its EP group (itself included)
            g = ep_group_of[q]
            mine = _experts_of(g.index(q), num_e, ep)
            return sum(routes[src][e] for src in g for e in mine)

        if ep > 1:
            g = ep_group_of[rank]
            mine = _experts_of(g.index(rank), num_e, ep)
            sent = sum(n for e, n in enumerate(routes[rank]) if e not in mine)
            recv = received(rank) - sum(routes[rank][e] for e in mine)
            out["ep"] = 2 * (sent + recv) * h * FLOAT + calls * (num_e - num_e // ep) * INDEX
        if etp > 1:
            etp_group = next(g for g in grid.groups("tp", expert=True) if rank in g)
            rows = sum(received(q) for q in etp_group)
            out["etp"] = 4 * (etp - 1) / etp * rows * h * FLOAT + calls * (etp - 1) * num_e * INDEX
    return out


# ----------------------------------------------------------------------------- measuring


def _traffic_of(frame, group, trainer) -> str:
    """Name the traffic of a collective from the frames that issued it."""
    while frame is not None and frame.f_globals.get("__name__") == "workers.parallel.comm":
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    source = _SOURCES.get(module, module)
    g = trainer.groups
    if source == "moe":
        return "ep" if group is g.ep_group else "etp"
    if source == "loss":
        return "loss:dp-cp" if group is g.dp_cp_group else "loss:pp" if group is g.pp_group else "loss:world"
    if source == "grads":
        from workers.parallel.data import GradBuffer

        buf = frame.f_locals.get("buf")
        if not isinstance(buf, GradBuffer):
            buf = frame.f_locals.get("self")
        params = buf.params if isinstance(buf, GradBuffer) else []
        if params and getattr(params[0], "is_expert", False):
            return "grads:expert"
        if params and getattr(params[0], "sequence_parallel", False):
            return "grads:sp"
        return "grads:dense"
    return source


def _attribute(trainer) -> dict:
    """Wrap this process's ``comm._count`` to also count bytes per (label, traffic)."""
    from workers.parallel import comm

    counts: dict[tuple[str, str], float] = defaultdict(float)
    original = comm._count

    def count(group, nbytes: float) -> None:
        original(group, nbytes)
        counts[(comm.group_label(group), _traffic_of(sys._getframe(1), group, trainer))] += nbytes

    comm._count = count
    return counts


def _count_routes(trainer):
    """Per-expert choice counts of this rank's routers (a forward hook on each)."""
    import torch

    num_e = trainer.job.model.num_moe_experts or 0
    routes = torch.zeros(max(num_e, 1), dtype=torch.int64)
    if num_e:
        def hook(module, inputs, outputs):
            routes.add_(torch.bincount(outputs[1].reshape(-1), minlength=num_e))

        for chunk in trainer.chunks:
            for layer in chunk.layers:
                layer.mlp.router.register_forward_hook(hook)
    return routes


def measure_trainer(trainer, iters: int = 2) -> dict:
    """Train ``iters`` iterations; the counters cover the last one only."""
    from workers.parallel import comm

    traffic = _attribute(trainer)
    routes = _count_routes(trainer)
    for _ in range(iters - 1):
        trainer.train_step()
    comm.reset_stats()
    traffic.clear()
    routes.zero_()
    metrics = trainer.train_step()
    handles = {k: trainer.groups.group(GROUP_OF[k]) for k in TRAFFIC if GROUP_OF[k]}
    labels = {k: comm.group_label(h) for k, h in handles.items() if h is not None}
    return {"stats": comm.stats(), "traffic": dict(traffic), "labels": labels, "routes": routes.tolist(),
            "loss": metrics["loss"], "step_time_s": metrics["step_time_s"]}


def measure_rank(rank: int, world_size: int, job: JobConfig, iters: int = 2) -> dict:
    """One rank of :func:`run_layout`: build the trainer and measure its last iteration."""
    from workers.train.trainer import Trainer

    return measure_trainer(Trainer(job, rank, world_size), iters)


@dataclass
class Row:
    traffic: str
    label: str
    measured: float  # mean bytes per rank
    minimum: float  # mean bytes per rank
    ratio: float  # worst rank


def compare(job: JobConfig, results: list[dict]) -> list[Row]:
    """Per traffic: measured vs minimum bytes (mean over ranks) and the worst rank's ratio."""
    routes = {r: res["routes"] for r, res in enumerate(results)}
    minima = [analytic_bytes(job, r, routes) for r in range(len(results))]
    measured = [defaultdict(float) for _ in results]
    label_of: dict[str, str] = {}
    for r, res in enumerate(results):
        for (label, traffic), nbytes in res["traffic"].items():
            measured[r][traffic] += nbytes
            label_of.setdefault(traffic, label)
        total = sum(res["traffic"].values())
        assert abs(total - sum(v["bytes"] for v in res["stats"].values())) < 1e-6, "attribution lost bytes"
        for k, label in res["labels"].items():
            label_of.setdefault(k, label)
    rows = []
    for k in TRAFFIC:
        meas = [mr.get(k, 0.0) for mr in measured]
        mins = [mn[k] for mn in minima]
        if max(meas) == 0 and max(mins) == 0:
            continue
        rows.append(Row(k, label_of.get(k, "-"), sum(meas) / len(meas), sum(mins) / len(mins),
                        max(ratio(a, b) for a, b in zip(meas, mins))))
    extra = sorted({k for mr in measured for k in mr} - set(TRAFFIC))
    for k in extra:  # traffic nobody accounted for: always redundant
        meas = [mr.get(k, 0.0) for mr in measured]
        rows.append(Row(k, label_of.get(k, "?"), sum(meas) / len(meas), 0.0, math.inf))
    return rows


def run_layout(layout: Layout, world: int | None = None, **kw) -> tuple[JobConfig, list[Row], list[dict]]:
    from tests.helpers.ranks import run_ranks

    world = world or WORLD[layout.name]
    job = layout_job(layout, world, **kw)
    results = run_ranks(measure_rank, world, args=(job,), timeout_s=300)
    return job, compare(job, results), results


def label_totals(results: list[dict], job: JobConfig, rows: list[Row]) -> dict[str, tuple[float, float]]:
    """Per comm label (what ``comm.stats()`` shows): mean measured and mean minimum bytes."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for res in results:
        for label, v in res["stats"].items():
            out[label][0] += v["bytes"] / len(results)
    for row in rows:
        out[row.label][1] += row.minimum
    return {k: (a, b) for k, (a, b) in out.items()}


def _fmt(nbytes: float) -> str:
    return f"{nbytes:,.0f}"


def print_table(name: str, rows: list[Row], totals: dict | None = None, file=None) -> None:
    for row in rows:
        flag = "" if row.ratio <= 1.05 else "  <-- above 1.05"
        print(f"{name:<26} {row.traffic:<13} {row.label:<10} {_fmt(row.measured):>13} {_fmt(row.minimum):>13} "
              f"{row.ratio:>7.3f}{flag}", file=file)
        name = ""
    for label, (meas, mini) in sorted((totals or {}).items()):
        print(f"{'':<26} {'= label':<13} {label:<10} {_fmt(meas):>13} {_fmt(mini):>13} {ratio(meas, mini):>7.3f}",
              file=file)


def header(file=None) -> None:
    print(f"{'layout':<26} {'traffic':<13} {'label':<10} {'meas B/rank':>13} {'min B/rank':>13} {'ratio':>7}",
          file=file)
    print("-" * 88, file=file)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated layout names")
    args = ap.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s]
    layouts = [l for l in LAYOUTS if not wanted or l.name in wanted]
    m, t = SMALL_MODEL, SMALL_TRAINING
    print(f"model: {m['num_layers']} layers, h {m['hidden_size']}, heads {m['num_attention_heads']} "
          f"(kv {m['num_query_groups']}), ffn {m['ffn_hidden_size']}, vocab {m['vocab_size']}, "
          f"seq {m['seq_length']}; global batch {t['global_batch_size']}, micro batch {t['micro_batch_size']}; "
          "MoE: 4 experts, top-2")
    header()
    worst = []
    t0 = time.perf_counter()
    for layout in layouts:
        job, rows, results = run_layout(layout)
        print_table(f"{layout.name} (w{job.world_size})", rows, label_totals(results, job, rows))
        worst.append((layout.name, max(r.ratio for r in rows)))
    print("-" * 88)
    print("worst ratio per layout: " + ", ".join(f"{n} {w:.3f}" for n, w in worst))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
