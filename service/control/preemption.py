"""Preemption and drain notices: the job saves a checkpoint of the current iteration and moves its ranks off the nodes about to go.

A launcher that can tell (the Ray launcher's ``drain_notices``: the nodes Ray is draining, with their
deadlines, :mod:`service.ranks.ray_drain`) is asked between calls, so within a call's time (about a
second of iterations) of the notice; so is a rank group that can tell (``notices()``: the ranks that
got a SIGTERM, local rank processes or Ray rank actors (:mod:`workers.rank.sigterm`; the Ray launcher
then drains their nodes), each with its deadline, ``fault_tolerance.sigterm_grace_s`` after it,
:class:`workers.rank.main.SigtermNotice`; the whole node of such a rank leaves). When a node holding
ranks is being drained, the controller
(:meth:`~service.control.controller.JobController`) has every rank save a checkpoint of the
iteration it finished (``save_now``, committed before the call returns), tears the attempt down,
records a ``preempted`` event (the PREEMPTED line: the nodes, the ranks, the checkpoint, how long the
save took and how long before the deadline it was committed) and starts a new attempt from that
checkpoint: Ray places no new work on a node being drained, so the ranks go to the other nodes, or,
with ``resources.min_nodes`` below ``num_nodes`` and no free node, the job shrinks dp
(:mod:`service.control.sizing` does not count nodes being drained). The RESTARTING transition that
follows carries ``data["preempted"]`` and is not a restart: preemptions count against
``fault_tolerance.max_preemptions`` (the one past it fails the job), never against ``max_restarts``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from service.control.events import JobEvent, JobState


@dataclass(frozen=True)
class Notice:
    """Nodes about to go that hold ranks: their ids, the ranks on them, the earliest deadline
    (seconds since the epoch; None: none given), when the controller saw it, and the ranks that got
    a SIGTERM (empty: a drain of the nodes)."""

    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    deadline: float | None
    seen: float
    signalled: tuple[int, ...] = ()


def node_of(record: dict) -> str:
    """A placement record's node: its Ray node id, else its plan node (a local process)."""
    return record.get("node_id") or f"node {record.get('node')}"


class PreemptionWatch:
    """Turns a launcher's drain notices (node id -> deadline) and a rank group's SIGTERM notices
    (rank -> deadline) into a :class:`Notice` for the nodes of a placement."""

    def __init__(self, notices: Callable[[], dict[str, float | None]] | None):
        self._notices = notices

    def check(self, placement: list[dict], signalled: dict[int, float | None] | None = None) -> Notice | None:
        """The notice for the nodes of ``placement`` (per-rank records with ``node_id``), or None.
        ``signalled``: the ranks that got a SIGTERM (their whole node leaves, as a drain would)."""
        if not placement:
            return None
        draining = dict(self._notices()) if self._notices is not None else {}
        for p in placement:
            if p["rank"] in (signalled or {}):
                node, deadline = node_of(p), signalled[p["rank"]]
                draining[node] = min((d for d in (draining.get(node), deadline) if d), default=None)
        hit = sorted({node_of(p) for p in placement if node_of(p) in draining})
        if not hit:
            return None
        deadlines = [draining[n] for n in hit if draining[n]]
        return Notice(tuple(hit), tuple(p["rank"] for p in placement if node_of(p) in hit),
                      min(deadlines) if deadlines else None, time.time(), tuple(sorted(signalled or ())))


def save_before_leaving(group) -> dict:
    """Every rank of ``group`` saves a checkpoint of its current iteration (``save_now``); rank 0's
    answer: ``{"iteration", "save_s", "retention"}``, {} when the group cannot or there is nowhere to save."""
    save = getattr(group, "save_now", None)
    answers = save() if save is not None else []
    return dict(answers[0]) if answers and answers[0] else {}


def is_preemption(event: JobEvent) -> bool:
    return event.kind == "preempted"


def count_preemptions(events: Iterable[JobEvent]) -> int:
    """The preemptions in a job's events (its ``preempted`` events)."""
    return sum(1 for e in events if is_preemption(e))


def preempted_event(state: JobState, notice: Notice, saved: dict, checkpoint: str | None, number: int,
                    limit: int) -> JobEvent:
    """The ``preempted`` event: what was drained, what was saved, and whether it beat the deadline."""
    done = time.time()
    nodes = ", ".join(n[:8] for n in notice.nodes)
    head = f"node(s) {nodes} (ranks {list(notice.ranks)}) " + (
        f"leaving: rank(s) {list(notice.signalled)} got SIGTERM" if notice.signalled else "drained")
    if notice.deadline is not None:
        head += f" with {notice.deadline - notice.seen:.1f} s to the deadline"
    if saved:
        left = "" if notice.deadline is None else f", {notice.deadline - done:.1f} s before the deadline"
        what = f"checkpoint of iteration {saved['iteration']} committed in {saved['save_s']:.2f} s{left}"
    else:
        what = "nothing saved (no checkpoint.dir, or no iteration yet): the job goes on from its last checkpoint"
    then = ("moving the ranks off" if number <= limit
            else f"fault_tolerance.max_preemptions {limit} is spent: the job fails (raise it to let the job move on)")
    data = {"nodes": list(notice.nodes), "ranks": list(notice.ranks), "signalled": list(notice.signalled),
            "deadline": notice.deadline,
            "notice_time": notice.seen, "saved_time": done if saved else None, "iteration": saved.get("iteration"),
            "save_s": saved.get("save_s"), "checkpoint": checkpoint if saved else None,
            "before_deadline_s": None if notice.deadline is None or not saved else round(notice.deadline - done, 3),
            "preemption": number, "max_preemptions": limit}
    return JobEvent.now("preempted", state, f"PREEMPTED: {head}; {what}; {then} (preemption {number} of at most "
                        f"{limit})", data)


__all__ = ["Notice", "PreemptionWatch", "node_of", "count_preemptions", "is_preemption", "preempted_event", "save_before_leaving"]
