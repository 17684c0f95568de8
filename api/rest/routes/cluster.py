"""``GET /api/v1/cluster``: where jobs run, and how many GPU slots are free."""

from __future__ import annotations

from fastapi import APIRouter

from api.rest.deps import ClusterDep, SchedulerDep
from api.rest.schemas import ClusterPublic
from service.spec.cost import gpu_type_of

router = APIRouter(tags=["cluster"])


@router.get("/cluster", response_model=ClusterPublic)
def get_cluster(cluster: ClusterDep, scheduler: SchedulerDep) -> dict:
    """The Ray address, the dashboard URL, every node's GPU slots (used = held by raytron's jobs) and
    accelerator, and the ``gpu_type`` a spec that names no accelerator is planned with."""
    used = scheduler.used_slots()
    nodes = [{"node_id": n.node_id, "gpus": n.gpus, "gpus_used": min(n.gpus, used.get(n.node_id, 0)),
              "gpus_free": max(0, n.gpus - used.get(n.node_id, 0)) if n.alive else 0, "alive": n.alive,
              "accelerator": n.accelerator}
             for n in cluster.nodes()]
    return {"ray_address": cluster.ray_address, "dashboard_url": cluster.dashboard_url,
            "gpu_type": gpu_type_of([n["accelerator"] for n in nodes if n["gpus"] > 0]), "nodes": nodes,
            "gpus_total": sum(n["gpus"] for n in nodes if n["alive"]),
            "gpus_free": sum(n["gpus_free"] for n in nodes), "queue_length": scheduler.queue_length()}
