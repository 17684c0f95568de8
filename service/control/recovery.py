"""The restore event of a restarted attempt of a job with in-memory checkpoints: which iteration, from where, and why not from memory.

With ``fault_tolerance.memory_interval`` every attempt after the first records one ``restore``
event after its placement: the iteration every rank restored (the one the job goes on from),
whether from memory (each rank's own copy, or a peer's replica for the ranks that were replaced:
:mod:`workers.rank.replicas`) or from the disk checkpoint, and then why memory was not enough
(both copies of some rank's state lost, say, when a node and the node holding its replicas fail
together).
"""

from __future__ import annotations

from service.control.events import JobEvent, JobState


def restore_event(state: JobState, iteration: int, disk: str | None, placement: list[dict]) -> JobEvent:
    """The ``restore`` event of an attempt whose ranks reported ``placement`` (their records)."""
    memory = [p for p in placement if str(p.get("resumed_from") or "").startswith("memory")]
    if memory:
        replaced = sorted(p["rank"] for p in memory if "replica" in p["resumed_from"])
        how = (f"ranks {replaced} from their replicas on other nodes, the others from their own copies" if replaced
               else "every rank from its own copy")
        spares = sorted(p["rank"] for p in placement if p.get("spare"))
        if spares:
            how += f"; ranks {spares} on a hot spare node (resources.spare_nodes)"
        return JobEvent.now("restore", state, f"restored iteration {iteration} from memory: {how}",
                            {"iteration": iteration, "source": "memory", "from_replicas": replaced,
                             "spare_ranks": spares})
    why = next((p["restore_note"] for p in placement if p.get("restore_note")), "no in-memory state")
    where = f"the disk checkpoint {disk}" if disk else "the start (no disk checkpoint)"
    return JobEvent.now("restore", state, f"restored iteration {iteration} from {where}: {why}",
                        {"iteration": iteration, "source": "disk" if disk else "start", "why": why, "checkpoint": disk})


__all__ = ["restore_event"]
