"""``GET /api/v1/cluster``: where jobs run, and how many GPU slots are free."""

from __future__ import annotations

from fastapi import APIRouter

from api.rest.deps import ClusterDep, SchedulerDep, StoreDep
from api.rest.schemas import ClusterPublic
from service.spec.cluster_figures import gpu_type_of

router = APIRouter(tags=["cluster"])
ACTIVE = ("STARTING", "RUNNING", "RESTARTING")


def active_spares(store) -> list[dict]:
    """The hot spares (resources.spare_nodes) of the active jobs, from each one's latest placement event."""
    out = []
    for row in store.list_jobs(states=ACTIVE):
        placed = store.events(row["id"], kind="placement")
        for spare in ((placed[-1]["data"] or {}).get("spares") or []) if placed else []:
            out.append({"job_id": row["id"], **spare})
    return out


@router.get("/cluster", response_model=ClusterPublic)
def get_cluster(cluster: ClusterDep, scheduler: SchedulerDep, store: StoreDep) -> dict:
    """The Ray address, the dashboard URL, every node's GPU slots (used = held by raytron's jobs) and
    accelerator, the active jobs' hot spares, and the ``gpu_type`` a spec that names no accelerator is planned with."""
    used = scheduler.used_slots()
    nodes = [{"node_id": n.node_id, "gpus": n.gpus, "gpus_used": min(n.gpus, used.get(n.node_id, 0)),
              "gpus_free": max(0, n.gpus - used.get(n.node_id, 0)) if n.alive else 0, "alive": n.alive,
              "accelerator": n.accelerator}
             for n in cluster.nodes()]
    return {"ray_address": cluster.ray_address, "dashboard_url": cluster.dashboard_url,
            "gpu_type": gpu_type_of([n["accelerator"] for n in nodes if n["gpus"] > 0]), "nodes": nodes,
            "spares": active_spares(store),
            "gpus_total": sum(n["gpus"] for n in nodes if n["alive"]),
            "gpus_free": sum(n["gpus_free"] for n in nodes), "queue_length": scheduler.queue_length()}
