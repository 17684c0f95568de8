"""Bytes each rank sends per iteration, per group, next to the analytic minimum (run by hand).

    .venv/bin/python -m bench.comm_bench [--only tp2,cp2-p2p] [--per-rank]

For each layout a small model trains two iterations on ``world <= 8`` local gloo ranks; the
counters of :mod:`workers.parallel.comm` are reset after the first, so the numbers are one
steady iteration. Every collective is attributed to the *traffic* that issued it (the calling
module, and for gradients the param group: :mod:`bench.comm_attribution`), because one communicator often serves several
group kinds (with tp2 on two ranks, "tp", "tp-dp-cp", "etp", ... are one rank set, hence one
handle and one label). Rows show the traffic, the comm label its group carries, the bytes per
rank (mean over ranks), the minimum below and ``ratio = measured / minimum`` (worst rank).

The minimum each row is compared with, and how it is derived: :mod:`bench.comm_minimum`.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

from bench.comm_attribution import measure_rank
from bench.comm_minimum import TRAFFIC, all_reduce_bytes, analytic_bytes, ratio  # noqa: F401 (all_reduce_bytes: interface)
from service.spec.spec import parse_spec, to_job_config
from workers.config import JobConfig

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
