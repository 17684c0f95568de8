"""The placement view: where each rank of a job runs, put together here once for every reader.

``GET /api/v1/jobs/{id}/placement`` returns :func:`placement_view` and the web console draws it
as it comes (``api/rest/static/console.js`` adds nothing); ``raytron run`` and ``raytron status JOB``
print its table with :func:`api.cli.tables.print_reported_placement`.

A rank's entry is the record the rank reported for its attempt (rank, ``node_id``, ``hostname``,
pid, ``local`` slot, its grid coordinates, ...), completed from the attempt's placement plan
where the record is silent, plus ``node``: the node the rank is drawn in (see :func:`node_of`).
"""

from __future__ import annotations

from typing import Callable

PLANNED = ("local", "tp", "cp", "dp", "pp", "ep", "etp", "expert_dp")
"""What the placement plan knows of a rank besides its node: taken from it when a record lacks it."""


def host_of(record: dict) -> str | None:
    """The machine a rank reported: its Ray node id, else its hostname (a rank run as a local
    process has no Ray node)."""
    return record.get("node_id") or record.get("hostname")


def node_of(record: dict, planned: dict | None = None, nodes: list | tuple = ()) -> str | int | None:
    """The node a rank is drawn in: the launcher's node index (local processes on one machine, placed
    as the plan's nodes), else :func:`host_of`, else the admitted cluster node of its planned node,
    else that planned node's index."""
    if record.get("node") is not None:
        return record["node"]
    if host_of(record):
        return host_of(record)
    if planned is None:
        return None
    index = planned.get("node")
    return nodes[index] if isinstance(index, int) and 0 <= index < len(nodes) else index


def placement_view(reported: list[dict], planned: Callable[[], list[dict]] | None = None,
                   nodes: list | tuple = ()) -> list[dict]:
    """The ranks' records, by rank, each with its ``node`` and what the plan adds.

    Args:
        reported: the placement records of one attempt (a "placement" event's ``data["placement"]``).
        planned: returns the attempt's plan, one entry per rank (``rank``, ``node`` index, ``local``
            and the coordinates, as :func:`service.spec.plan.plan_job` lists them); called only when a
            record lacks something the plan has. None: no plan.
        nodes: the cluster nodes admitted for the attempt, by the plan's node index.
    """
    ranks = sorted(reported, key=lambda r: r.get("rank", 0))
    plan: dict[int, dict] = {}
    if planned is not None and any(k not in r for r in ranks for k in PLANNED):
        plan = {p["rank"]: p for p in planned()}
    out = []
    for r in ranks:
        p = plan.get(r.get("rank"))
        extra = {k: p[k] for k in PLANNED if k in p and k not in r} if p else {}
        out.append({**r, **extra, "node": node_of(r, p, nodes)})
    return out


