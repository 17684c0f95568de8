"""The GPU slots a scheduler's launched jobs hold: each job's nodes, each owner's share, and what is left free.

A job holds its slots from its admission (or, after a server restart, its recovery) until the
scheduler releases its runner; :func:`service.server.queue.admit` admits the queue against the
slots left free. Not thread-safe on its own: :class:`service.server.scheduler.Scheduler`'s lock
guards it.
"""

from __future__ import annotations

from typing import Iterator, Mapping

from service.server.queue import QueuedJob, admit


def free_slots(total: Mapping[str, int], used: Mapping[str, int]) -> dict[str, int]:
    """GPU slots left per node of ``total`` once ``used`` are taken."""
    return {node: max(0, n - used.get(node, 0)) for node, n in total.items()}


class HeldSlots:
    """The launched jobs and the slots they hold: ``job_id in held``, ``list(held)``."""

    def __init__(self):
        self._nodes: dict[str, tuple[tuple[str, ...], int]] = {}  # launched job -> (nodes, gpus per node)
        self._owners: dict[str, tuple[str | None, int]] = {}  # launched job -> (owner, GPU slots)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._nodes

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def hold(self, job_id: str, nodes: tuple[str, ...], job: QueuedJob) -> None:
        """``job``'s bundles on ``nodes``, held for ``job_id`` (counted in its owner's share)."""
        self._nodes[job_id] = (nodes, job.gpus_per_node)
        self._owners[job_id] = (job.owner, job.num_gpus)

    def drop(self, job_id: str) -> None:
        self._nodes.pop(job_id, None)
        self._owners.pop(job_id, None)

    def used(self) -> dict[str, int]:
        """GPU slots held per node."""
        used: dict[str, int] = {}
        for nodes, gpus in self._nodes.values():
            for node in nodes:
                used[node] = used.get(node, 0) + gpus
        return used

    def by_owner(self) -> dict[str | None, int]:
        """GPU slots each owner's launched jobs hold together (what a quota counts)."""
        held: dict[str | None, int] = {}
        for owner, gpus in self._owners.values():
            held[owner] = held.get(owner, 0) + gpus
        return held

    def recovered_nodes(self, job: QueuedJob, nodes: tuple, total: Mapping[str, int]) -> tuple:
        """The nodes a recovered job holds: its admitted ``nodes``, or, when they are no longer all
        in the cluster's ``total`` (one was replaced), nodes with room for it now."""
        if nodes and all(n in total for n in nodes):
            return nodes
        plan = admit(free_slots(total, self.used()), [job], cluster_total=total)
        return tuple(str(n) for n in plan.start[0].nodes) if plan.start else nodes
