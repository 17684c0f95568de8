"""Ray's drain notices: the nodes Ray is draining (a preemption notice, ``ray drain-node``) and their deadlines.

When a cloud provider announces that it will take a node back, the autoscaler asks the GCS to drain
it (``DRAIN_NODE_REASON_PREEMPTION`` with a deadline); ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` does the same by hand. From then on Ray
schedules nothing new there (a placement group goes to the other nodes), the work already there
runs on, and the node is killed at the deadline (by whoever asked: Ray itself does not); a node
left idle by its drain exits at once. :func:`draining_nodes` is what the job controller polls
between calls (:mod:`service.control.preemption`); :func:`schedulable_totals` is what the scaling
policy may count on. Needs a connected driver.
"""

from __future__ import annotations


def draining_nodes() -> dict[str, float | None]:
    """Node id -> the drain's deadline (seconds since the epoch; None: no deadline) of every node
    Ray is draining; empty when the GCS cannot be asked."""
    try:
        from ray._private.state import state

        found = state.get_draining_nodes()
    except Exception:  # noqa: BLE001 - a notice is advisory: no answer means none seen
        return {}
    return {node: (ms / 1000.0 if ms else None) for node, ms in found.items()}


def schedulable_totals() -> list[dict]:
    """Each alive node's total resources, less the nodes being drained (no new work goes there)."""
    from service.ranks.ray_nodes import node_totals

    return node_totals(excluding=draining_nodes())
