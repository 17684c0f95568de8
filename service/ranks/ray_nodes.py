"""What the Ray cluster offers a job: its alive and dead nodes, whether a job could ever fit (and
the wait for its placement group that stops when it cannot), and why one does not (the numbers a
user needs to fix the spec or the cluster). Needs a connected driver."""

from __future__ import annotations

import time
from typing import Callable

from service.control.rank_group import LauncherConfig
from workers.config import JobConfig


def dead_nodes() -> set[str]:
    """Ids of the nodes Ray reports dead (empty when it cannot be asked)."""
    import ray

    try:
        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
    except Exception:  # noqa: BLE001 - only an annotation
        return set()


def node_totals(excluding=()) -> list[dict]:
    """Each alive node's total resources, leaving out the node ids in ``excluding``."""
    import ray

    return [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in excluding]


def could_ever_fit(job: JobConfig, strategy: str, bundle: dict) -> bool:
    """Whether the cluster's total (not free) resources can hold the bundles at all."""
    holds = []  # bundles each node could hold if it were empty
    for r in node_totals():
        n = int(r.get("GPU", 0) // bundle["GPU"])
        holds.append(min(n, int(r.get("CPU", 0) // bundle["CPU"])) if bundle["CPU"] else n)
    if strategy == "STRICT_SPREAD":
        return sum(1 for h in holds if h >= 1) >= job.num_nodes
    return sum(holds) >= job.num_nodes


def wait_placed(pg, timeout_s: float, fits: Callable[[], bool] | None = None) -> bool:
    """Wait up to ``timeout_s`` for placement group ``pg``; with ``fits``, stop early (False) once it
    says the cluster cannot hold the job (asked every half second): an elastic job's retry after a
    lost node, which its controller then shrinks instead of waiting out the timeout."""
    if fits is None:
        return pg.wait(timeout_seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if pg.wait(timeout_seconds=max(0.0, min(0.5, left))):
            return True
        if left <= 0.5 or not fits():
            return False


def capacity_message(job: JobConfig, cfg: LauncherConfig, bundle: dict, waited: bool = True) -> str:
    """Why a placement group does not fit: what the job needs next to what the cluster has."""
    import ray

    totals = [r for r in node_totals() if r.get("GPU", 0) > 0]  # nodes that can hold ranks (not a CPU-only head)
    gpus = [int(r.get("GPU", 0)) for r in totals]
    fitting = sum(1 for g in gpus if g >= job.gpus_per_node)
    free = ray.available_resources().get("GPU", 0)
    distinct = "distinct " if cfg.strategy == "STRICT_SPREAD" else ""
    when = f"waited {cfg.placement_timeout_s:g}s" if waited else "no node can join this cluster"
    return (f"the job does not fit the cluster: it needs {job.num_nodes} {distinct}node(s) with "
            f"{job.gpus_per_node} GPU(s) and {bundle['CPU']:g} CPU(s) each ({job.num_nodes * job.gpus_per_node} "
            f"GPUs); the cluster has {len(totals)} node(s) with GPUs {gpus}, {fitting} of them with >= "
            f"{job.gpus_per_node} GPUs, {free:g} GPU(s) free ({when}). Lower resources.num_nodes or "
            f"gpus_per_node, or add nodes (--simulate NODESxGPUS locally)")
