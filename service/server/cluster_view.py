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


class ClusterView(Protocol):
    """What the scheduler and ``GET /api/v1/cluster`` know of the cluster."""

    ray_address: str | None
    dashboard_url: str | None

    def nodes(self) -> list[NodeSlots]:
        """The alive nodes and their GPU slots (all of them, free or not)."""


class StaticCluster:
    """A fixed cluster of ``num_nodes`` x ``gpus_per_node`` slots (``--simulate``, tests)."""

    def __init__(self, num_nodes: int, gpus_per_node: int, *, ray_address: str | None = None,
                 dashboard_url: str | None = None):
        self._nodes = [NodeSlots(f"node-{i}", gpus_per_node) for i in range(num_nodes)]
        self.ray_address, self.dashboard_url = ray_address, dashboard_url

    def nodes(self) -> list[NodeSlots]:
        return list(self._nodes)
