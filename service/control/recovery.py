"""Where an attempt restores from: the disk checkpoint it resumes from, and the restore event of a job with in-memory checkpoints.

:func:`resume_source` is the checkpoint every attempt starts from (the controller names it in the
STARTING event).

With ``fault_tolerance.memory_interval`` every attempt after the first records one ``restore``
event after its placement: the iteration every rank restored (the one the job goes on from),
whether from memory (each rank's own copy, or a peer's replica for the ranks that were replaced:
:mod:`workers.rank.replicas`) or from the disk checkpoint, and then why memory was not enough
(both copies of some rank's state lost, say, when a node and the node holding its replicas fail
together).

:class:`KeptRanks` is what a launcher keeps between a job's attempts: the ranks that survived a
failed attempt, reset, for the next one to start on (the Ray launcher's actors, the process
launcher's rank processes).
"""

from __future__ import annotations

from service.control.events import JobEvent, JobState
from workers.config import CheckpointConfig


def resume_source(ckpt: CheckpointConfig, recorded: int) -> str | None:
    """The latest complete checkpoint under ``ckpt.dir``, else ``ckpt.load``, else None.

    Once the job has recorded iterations (``recorded``), the latest one not past them: the ranks may
    save a checkpoint and die before the call that saved it returns its metrics, and resuming from
    it would leave those iterations out of the curve (``keep_last`` >= 2 keeps the one before)."""
    from workers.checkpoint.storage import Storage, list_checkpoints

    if ckpt.dir:
        found = list_checkpoints(Storage.from_uri(ckpt.dir))
        held = [c for c in found if c.iteration <= recorded] if recorded else []
        if found:
            return (held or found)[-1].storage.uri  # a URI on an object store, not its bare path
    return ckpt.load


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


class KeptRanks:
    """Per job id, the ranks a launcher kept from a failed attempt for the next (each kept set has a
    ``release()`` that stops its ranks): the group of the next attempt takes them, a failed attempt
    parks its survivors, and the job's end releases what is left."""

    def __init__(self):
        self._kept: dict = {}

    def take(self, job_id: str):
        """The ranks kept for ``job_id``'s next attempt (None: none); the caller owns them."""
        return self._kept.pop(job_id, None)

    def park(self, job_id: str, kept) -> None:
        self.release(job_id)
        self._kept[job_id] = kept

    def release(self, job_id: str) -> None:
        kept = self.take(job_id)
        if kept is not None:
            kept.release()


__all__ = ["KeptRanks", "restore_event", "resume_source"]
