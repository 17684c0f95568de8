"""The cluster as the scheduler sees it: nodes and their GPU slots (:class:`ClusterView`), and a
fixed one (:class:`StaticCluster`: ``--simulate``, tests). Re-exported by :mod:`service.server.scheduler`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class NodeSlots:
    node_id: str
    gpus: int
    alive: bool = True
    accelerator: str | None = None
    """The node's accelerator as Ray labels it (its ``accelerator_type:H100`` resource), if any."""


class ClusterView(Protocol):
    """What the scheduler and ``GET /api/v1/cluster`` know of the cluster."""

    ray_address: str | None
    dashboard_url: str | None

    def nodes(self) -> list[NodeSlots]:
        """The alive nodes and their GPU slots (all of them, free or not)."""


def reported_gpu_type(cluster: ClusterView) -> str | None:
    """The ``resources.gpu_type`` the cluster's GPU nodes report through Ray
    (:func:`service.spec.cost.gpu_type_of`), or None (none reported, a mixed cluster, or the cluster
    cannot be asked now: the spec's own figures, or the simulated CPU cluster's, apply)."""
    from service.spec.cluster_figures import gpu_type_of

    try:
        nodes = [n for n in cluster.nodes() if n.gpus > 0]
    except Exception:  # noqa: BLE001 (a cluster that does not answer must not refuse the request)
        return None
    return gpu_type_of([n.accelerator for n in nodes])


class StaticCluster:
    """A fixed cluster of ``num_nodes`` x ``gpus_per_node`` slots (``--simulate``, tests)."""

    def __init__(self, num_nodes: int, gpus_per_node: int, *, ray_address: str | None = None,
                 dashboard_url: str | None = None):
        self._nodes = [NodeSlots(f"node-{i}", gpus_per_node) for i in range(num_nodes)]
        self.ray_address, self.dashboard_url = ray_address, dashboard_url

    def nodes(self) -> list[NodeSlots]:
        return list(self._nodes)
