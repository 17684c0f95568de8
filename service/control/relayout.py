"""Re-pick the layout on an elastic resize (``fault_tolerance.relayout_on_resize``).

:class:`ElasticRelayout` is :class:`~service.control.policy.ElasticDataParallel` first: the size
the job's own layout takes on the nodes left (dp shrinks). Then, for every node count from the
nodes available (at most ``resources.num_nodes``) down to that size, the cost model searches the
layouts of those nodes (:func:`service.spec.spec.search_layouts`: tp, pp, vpp, cp, ep and sequence
parallelism open; micro batch, optimizer, recompute and order as the job has them; TP in a node,
memory margin, every grid and batch rule). The best of those re-places the dp-only choice when its
predicted step time is below the dp-only layout's by at least :data:`MIN_GAIN`. The global batch
stays, so the loss curve is the one of any layout (checkpoints reshard across layouts:
tests/workers/checkpoint/test_checkpoint_reshard.py); a job that grows back returns to its own layout.
"""

from __future__ import annotations

import json

from service.control.policy import ElasticDataParallel, ScalingDecision
from service.spec.auto import SIZE_FIELDS
from service.spec.placement import plan_placement
from service.spec.plan import estimate
from service.spec.spec import grid_of, parse_spec, search_layouts, to_job_config
from workers.config import JobConfig
from workers.grid import ParallelGrid

MIN_GAIN = 0.05
"""A re-pick must be predicted at least this much faster (a share of the dp-only step time)."""
OPEN = (*SIZE_FIELDS.values(), "sequence_parallel")


def _on_nodes(data: dict, num_nodes: int) -> dict:
    res = {**data["resources"], "num_nodes": num_nodes, "min_nodes": None}
    return {**data, "resources": res, "fault_tolerance": {**data["fault_tolerance"], "relayout_on_resize": False}}


def predicted_step_s(data: dict) -> float:
    """The cost model's step time of a concrete spec's data."""
    spec = parse_spec(data)
    grid = grid_of(spec)
    node_of = [p.node for p in plan_placement(grid, spec.resources.gpus_per_node, spec.resources.num_nodes)]
    return estimate(spec, grid, node_of)["predicted_step_s"]


class ElasticRelayout(ElasticDataParallel):
    """Elastic dp, or a new layout when the cost model predicts a gain (module docstring)."""

    def decide(self, job: JobConfig, available_nodes: int) -> ScalingDecision:
        base = super().decide(job, available_nodes)
        if base.num_nodes is None or not job.relayout_spec or base.num_nodes == job.num_nodes:
            return base
        data = json.loads(job.relayout_spec)
        current = predicted_step_s(_on_nodes(data, base.num_nodes))
        best = None
        for n in range(min(job.num_nodes, available_nodes), base.num_nodes - 1, -1):
            open_ = _on_nodes(data, n)
            open_["parallel"] = {**open_["parallel"], **{f: "auto" for f in OPEN}}
            try:
                cand = search_layouts(open_)["candidates"][0]
            except ValueError:
                continue  # no layout of n nodes is valid or fits
            if best is None or cand["predicted_step_s"] < best[1]["predicted_step_s"]:
                best = (n, cand)
        if best is None or best[1]["predicted_step_s"] > current * (1 - MIN_GAIN):
            return base
        n, cand = best
        parallel = to_job_config(parse_spec(cand["data"])).parallel
        if n == base.num_nodes and parallel == job.parallel:
            return base
        return ScalingDecision(n, ParallelGrid.from_config(parallel, n * job.gpus_per_node).sizes(),
                               f"re-picked: predicted {cand['predicted_step_s']:.4g} s per iteration against "
                               f"{current:.4g} s for dp alone on {base.num_nodes} node(s)", parallel=parallel)
