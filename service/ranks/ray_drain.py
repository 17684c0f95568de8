"""Ray's drain notices: the nodes Ray is draining (a preemption notice, ``ray drain-node``) and their deadlines.

When a cloud provider announces that it will take a node back, the autoscaler asks the GCS to drain
it (``DRAIN_NODE_REASON_PREEMPTION`` with a deadline); ``ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`` does the same by hand. From then on Ray
schedules nothing new there (a placement group goes to the other nodes), the work already there
runs on, and the node is killed at the deadline (by whoever asked: Ray itself does not); a node
left idle by its drain exits at once. :func:`draining_nodes` is what the job controller polls
between calls (:mod:`service.control.preemption`); :func:`schedulable_totals` is what the scaling
policy may count on; :func:`drain_node` asks for a drain itself, when a rank actor got a SIGTERM.
Needs a connected driver.
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


def drain_node(node_id: str, deadline: float | None, message: str) -> str:
    """Ask Ray to drain ``node_id`` as a preemption (what ``ray drain-node`` and the autoscaler ask):
    a rank actor there got a SIGTERM (:mod:`workers.rank.sigterm`), so its node is going and nothing
    new may be placed on it. ``deadline``: seconds since the epoch (None: none). Returns "" when Ray
    accepted, else why not (the notice holds anyway; only the next placement may land there again)."""
    import time

    try:
        import ray
        from ray.core.generated import autoscaler_pb2

        ms = int(deadline * 1000) if deadline else 0
        if ms and ms <= time.time() * 1000:
            ms = 0  # past already: the GCS refuses a deadline in the past
        accepted, why = ray._private.worker.global_worker.gcs_client.drain_node(
            node_id, autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION, message, ms)
    except Exception as exc:  # noqa: BLE001 - advisory, as the notice is
        return f"{type(exc).__name__}: {exc}"
    return "" if accepted else (why or "refused")


def schedulable_totals() -> list[dict]:
    """Each alive node's total resources, less the nodes being drained (no new work goes there)."""
    from service.ranks.ray_nodes import node_totals

    return node_totals(excluding=draining_nodes())


class SigtermNotices:
    """The rank actors of one attempt that got a SIGTERM (:mod:`workers.rank.sigterm`): taken out of
    each ``run`` answer (:meth:`take`), their nodes drained (:func:`drain_node`), and reported to the
    job controller as a rank group's ``notices()`` (rank -> deadline, :mod:`service.control.preemption`)."""

    def __init__(self, job_id: str):
        self.job_id, self.deadlines = job_id, {}

    def take(self, per_rank: list[list[dict]], placement: list) -> None:
        from workers.rank.sigterm import take_notices

        for rank, deadline in take_notices(per_rank).items():
            self.deadlines[rank] = deadline
            drain_node(placement[rank].node_id, deadline, f"raytron: rank {rank} of job {self.job_id} got SIGTERM")

    def notices(self) -> dict[int, float | None]:
        return dict(self.deadlines)
