"""``parallel: auto``: choose a layout with the cost model. Pure; runs nothing.

Spelling. The whole section may be the string ``auto``, or any of these fields may be ``auto``
while the others are fixed: ``parallel.tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``virtual_pipeline_model_parallel_size``, ``context_parallel_size``, ``expert_model_parallel_size``,
``sequence_parallel``, ``use_distributed_optimizer``, and outside the section
``training.micro_batch_size`` and ``model.recompute_granularity``. ``parallel: auto`` leaves
``order``, ``cp_comm_type`` and ``expert_tensor_parallel_size`` at their defaults; micro batch and
recompute are chosen only when they say ``auto``.

Search (:func:`search`). Every combination of the open fields is built as a concrete spec and
validated by the spec's own rules (the ``validate`` function given, :class:`~service.spec.spec.JobSpec`;
no rule is repeated here), TP at most ``gpus_per_node`` (a TP group stays in a node). Each valid
layout is costed by :func:`service.spec.plan.estimate`; those whose peak bytes per rank exceed
``MEMORY_MARGIN`` x the accelerator's memory are dropped, the rest ranked by predicted step time
(then peak memory, then fewer model-parallel ranks). Open sizes range over the divisors of the
world size (pp also dividing num_layers; vpp over the divisors of num_layers/pp up to
:data:`MAX_VPP`), micro batch over powers of two up to :data:`MAX_MICRO_BATCH`, recompute over
none and full (uniform, 1 layer; selective saves nothing with flash attention, see cost.py).
:func:`resolve` returns the spec data with the chosen values written in, so the job that is
stored and run is a concrete spec.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from typing import Callable

from pydantic import BaseModel, ValidationError

from service.spec.cluster_figures import cluster_of
from service.spec.cost import MEMORY_MARGIN
from service.spec.placement import plan_placement
from service.spec.plan import count_traffic, estimate
from service.spec.shapes import Shapes
from service.spec.model_section import ModelSpec
from service.spec.sections import AUTO, ParallelSpec, ResourcesSpec, TrainingSpec, resources_problems
from workers.grid import ParallelGrid

MAX_VPP = 8
MAX_MICRO_BATCH = 16
TOP = 10
"""Candidates a search reports (best first)."""

SIZE_FIELDS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
               "ep": "expert_model_parallel_size"}
PARALLEL_AUTO = (*SIZE_FIELDS.values(), "sequence_parallel", "use_distributed_optimizer")


def _plain(data) -> dict:
    """A spec's data as plain dicts (sections given as models are dumped)."""
    out = dict(data)
    for k, v in out.items():
        if isinstance(v, BaseModel):
            out[k] = v.model_dump()
    return out


def auto_fields(data) -> list[str]:
    """The ``section.field`` paths a spec's data leaves to the search (empty: a concrete spec)."""
    if not isinstance(data, dict):
        return []
    data = _plain(data)
    par = data.get("parallel")
    if par == AUTO:
        out = [f"parallel.{f}" for f in PARALLEL_AUTO]
    elif isinstance(par, dict):
        out = [f"parallel.{f}" for f in PARALLEL_AUTO if par.get(f) == AUTO]
    else:
        out = []
    for section, name in (("training", "micro_batch_size"), ("model", "recompute_granularity")):
        sec = data.get(section)
        if isinstance(sec, dict) and sec.get(name) == AUTO:
            out.append(f"{section}.{name}")
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(data: dict, open_: set[str]) -> dict[str, list]:
    """The values each field may take (one value for a fixed field)."""
    model = ModelSpec.model_validate({k: v for k, v in (data.get("model") or {}).items()
                                      if k != "recompute_granularity"})
    res = ResourcesSpec.model_validate(data.get("resources") or {})
    par = ParallelSpec.model_validate(data["parallel"])
    train = TrainingSpec.model_validate(data.get("training") or {})
    world = res.num_nodes * res.gpus_per_node
    divs = _divisors(world)

    def pick(name: str, values: list):
        path = f"parallel.{name}"
        return values if path in open_ else [getattr(par, name)]

    c = {"tp": pick(SIZE_FIELDS["tp"], [d for d in divs if d <= res.gpus_per_node]),
         "pp": pick(SIZE_FIELDS["pp"], [d for d in divs if model.num_layers % d == 0]),
         "cp": pick(SIZE_FIELDS["cp"], divs),
         "ep": pick(SIZE_FIELDS["ep"], divs if model.num_moe_experts else [1]),
         "vpp": pick(SIZE_FIELDS["vpp"], None),  # filled per pp below
         "sp": pick("sequence_parallel", None),
         "dist": pick("use_distributed_optimizer", [True]),  # validated once with True; both costed
         "mbs": ([2 ** i for i in range(MAX_MICRO_BATCH.bit_length()) if 2 ** i <= train.global_batch_size]
                 if "training.micro_batch_size" in open_ else [train.micro_batch_size]),
         "recompute": [None, "full"] if "model.recompute_granularity" in open_ else [model.recompute_granularity]}
    return {**c, "world": world, "gpus_per_node": res.gpus_per_node, "layers": model.num_layers,
            "gbs": train.global_batch_size, "etp": par.expert_tensor_parallel_size, "order": par.order}


def _layouts(c: dict):
    """(tp, pp, vpp, cp, ep, sp) tuples that pass the cheap divisibility checks (the spec checks the rest)."""
    world = c["world"]
    for tp in c["tp"]:
        for pp in c["pp"]:
            for cp in c["cp"]:
                if world % (tp * pp * cp):
                    continue
                for ep in c["ep"]:
                    if world % ((c["etp"] or tp) * ep * pp):
                        continue
                    vpps = c["vpp"]
                    if vpps is None:
                        per = c["layers"] // pp
                        vpps = [None] + ([v for v in _divisors(per) if 2 <= v <= MAX_VPP] if pp > 1 else [])
                    sps = c["sp"] if c["sp"] is not None else ([True, False] if tp > 1 else [False])
                    for vpp in vpps:
                        for sp in sps:
                            yield tp, pp, vpp, cp, ep, sp


def _with(data: dict, *, tp, pp, vpp, cp, ep, sp, dist, mbs, recompute) -> dict:
    """The data with every open field set (recompute full: uniform, 1 layer unless the spec says)."""
    out = _plain(data)
    par = out["parallel"]
    par = {} if par == AUTO else dict(par)
    par.update({SIZE_FIELDS["tp"]: tp, SIZE_FIELDS["pp"]: pp, SIZE_FIELDS["vpp"]: vpp, SIZE_FIELDS["cp"]: cp,
                SIZE_FIELDS["ep"]: ep, "sequence_parallel": sp, "use_distributed_optimizer": dist})
    out["parallel"] = par
    out["training"] = {**(out.get("training") or {}), "micro_batch_size": mbs}
    model = dict(out.get("model") or {})
    if model.get("recompute_granularity") == AUTO:
        model["recompute_granularity"] = recompute
        if recompute == "full":
            if model.get("recompute_method") is None:
                model["recompute_method"] = "uniform"
            if model.get("recompute_num_layers") is None:
                model["recompute_num_layers"] = 1
        else:
            model.pop("recompute_method", None)
            model.pop("recompute_num_layers", None)
    out["model"] = model
    return out


def _candidate(spec, grid: ParallelGrid, data: dict, est: dict) -> dict:
    p = spec.parallel
    step = est["step_seconds"]
    return {"sizes": {"tp": grid.tp, "pp": grid.pp, "vpp": grid.vpp, "cp": grid.cp, "ep": grid.ep, "dp": grid.dp},
            "order": grid.order, "sequence_parallel": p.sequence_parallel,
            "micro_batch_size": spec.training.micro_batch_size,
            "use_distributed_optimizer": p.use_distributed_optimizer,
            "recompute_granularity": spec.model.recompute_granularity,
            "predicted_step_s": est["predicted_step_s"], "peak_bytes_per_rank": est["peak_bytes_per_rank"],
            "fits": est["fits"], "activation_bytes": est["activation_bytes"]["total"],
            "state_bytes": est["state_bytes"]["total"], "bubble_s": step["bubble"],
            "cross_node_bytes": est["cross_node_bytes"], "step_seconds": step, "data": data}


AUTO_MAX_WORLD_SIZE = 64
"""The largest world an ``auto`` spec is searched for. The search counts every layout's traffic
group by group (the plan's own traffic model), which grows with the world size: about 2 s for 16
ranks, 5 s for 64, 37 s for 256 and minutes for 1024 on the 2-core machine; a spec is resolved
where it is read (the REST server included), so larger worlds are refused until the traffic is
counted per group kind rather than per group."""


def search(data: dict, validate: Callable[[dict], object], top: int = TOP) -> dict:
    """Every valid layout of a spec's open fields, costed; the ``top`` fitting ones, best first.

    Returns ``{"candidates": [...], "chosen": 0, "open": [...], "considered", "valid", "fit",
    "memory_limit_bytes", "cluster"}``; each candidate carries ``data``, the concrete spec data.
    Raises ValueError when no layout is valid or none fits, with the closest one's numbers and a fix.
    """
    data = _plain(data)
    open_ = set(auto_fields(data))
    if data.get("parallel") is None:
        data["parallel"] = {}
    base = dict(data)
    if base["parallel"] == AUTO:
        base["parallel"] = {}
    base["parallel"] = {k: v for k, v in base["parallel"].items() if v != AUTO}
    problems = resources_problems(ResourcesSpec.model_validate(data.get("resources") or {}))
    if problems:  # every candidate would fail on them: say so once
        raise ValueError("; ".join(problems))
    c = _choices(base, open_)
    if c["world"] > AUTO_MAX_WORLD_SIZE:
        raise ValueError(f"parallel: auto searches layouts for at most {AUTO_MAX_WORLD_SIZE} ranks; this job has "
                         f"{c['world']} (resources.num_nodes x gpus_per_node): give the parallel sizes yourself "
                         f"(the cost of each is in `raytron plan SPEC`)")
    considered, valid, fitting, unfit, first_problem = 0, 0, [], [], None
    for tp, pp, vpp, cp, ep, sp in _layouts(c):
        for mbs in c["mbs"]:
            if c["gbs"] % (mbs * (c["world"] // (tp * pp * cp))):
                continue
            considered += 1
            concrete = _with(data, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, sp=sp, dist=c["dist"][0], mbs=mbs,
                             recompute=c["recompute"][-1])
            try:
                spec = validate(concrete)
            except ValidationError as e:
                first_problem = first_problem or "; ".join(err["msg"].removeprefix("Value error, ")
                                                           for err in e.errors())
                continue
            except ValueError as e:
                first_problem = first_problem or str(e)
                continue
            valid += 1
            grid = ParallelGrid.from_config(spec.parallel, spec.world_size)
            node_of = [pl.node for pl in plan_placement(grid, spec.resources.gpus_per_node,
                                                        spec.resources.num_nodes)]
            tr = count_traffic(Shapes.of(spec), spec, grid, node_of)
            dists = [False, True] if "parallel.use_distributed_optimizer" in open_ else c["dist"]
            for dist in dists:
                for rec in c["recompute"]:
                    variant = _with(data, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, sp=sp, dist=dist, mbs=mbs,
                                    recompute=rec)
                    vspec = spec.model_copy(update={
                        "parallel": spec.parallel.model_copy(update={"use_distributed_optimizer": dist}),
                        "model": spec.model.model_copy(update={
                            k: variant["model"].get(k) for k in
                            ("recompute_granularity", "recompute_method", "recompute_num_layers")})})
                    cand = _candidate(vspec, grid, variant, estimate(vspec, grid, node_of, tr))
                    (fitting if cand["fits"] else unfit).append(cand)
    cluster = cluster_of(ResourcesSpec.model_validate(data.get("resources") or {}))
    limit = MEMORY_MARGIN * cluster.memory_bytes
    if not valid:
        raise ValueError(f"parallel: auto found no valid layout among {considered} for world_size {c['world']}"
                         + (f"; e.g. {first_problem}" if first_problem else "; check the fixed fields"))
    if not fitting:
        best = min(unfit, key=lambda x: x["peak_bytes_per_rank"])
        s = best["sizes"]
        raise ValueError(
            f"parallel: auto found no layout that fits {cluster.memory_bytes / 1e9:g} GB x margin {MEMORY_MARGIN} = "
            f"{limit / 1e9:.1f} GB per rank ({cluster.name}); the smallest, tp {s['tp']} pp {s['pp']} cp {s['cp']} "
            f"ep {s['ep']} dp {s['dp']}, needs {best['peak_bytes_per_rank'] / 1e9:.1f} GB; add nodes, use a larger "
            f"resources.gpu_type / gpu_memory_gb, or let micro_batch_size and recompute_granularity be auto")
    fitting.sort(key=lambda x: (x["predicted_step_s"], x["peak_bytes_per_rank"],
                                x["sizes"]["tp"] * x["sizes"]["pp"] * x["sizes"]["cp"] * x["sizes"]["ep"]))
    return {"candidates": fitting[:top], "chosen": 0, "open": sorted(open_), "considered": considered,
            "valid": valid, "fit": len(fitting), "memory_limit_bytes": limit, "cluster": cluster.as_dict()}


@lru_cache(maxsize=32)
def _search_cached(key: str, validate: Callable[[dict], object]) -> dict:
    return search(json.loads(key), validate)


def search_once(data: dict, validate: Callable[[dict], object]) -> dict:
    """:func:`search`, remembered per spec (``raytron plan --auto`` and the spec's own resolution share it)."""
    return copy.deepcopy(_search_cached(json.dumps(_plain(data), sort_keys=True), validate))


def resolve(data: dict, validate: Callable[[dict], object]) -> dict:
    """The spec data with its ``auto`` fields chosen (the best fitting layout); unchanged when it has none.
    Deterministic, so a spec resolves the same way every time it is read. Raises ValueError as :func:`search`."""
    if not auto_fields(data):
        return data
    found = search_once(data, validate)
    return found["candidates"][found["chosen"]]["data"]
