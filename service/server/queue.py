"""Gang admission: which queued jobs start now, as pure functions over slot counts.

Ray Jobs has no queue (ray-project/ray#41241), so raytron keeps its own. A job's ranks are
placed as one bundle of ``gpus_per_node`` GPU slots on each of ``num_nodes`` distinct nodes
(a ``STRICT_SPREAD`` placement group; see :mod:`service.spec.placement`), and a job starts only
when the cluster can hold *all* of them at once: a partial gang would hold slots while it
waits for the rest, and two partial gangs can wait on each other forever.

Order: higher ``priority`` first, then earlier ``submitted_at``, then the job id (so the order
is total and the same on every call).

Head-of-line policy: **strict order, no backfill.** When the first job in that order cannot
start, every job behind it waits too, even one that would fit in the slots left over. raytron
knows no job's run time, so a backfilled job could hold the very slots the head job waits for
and a steady stream of small jobs could keep the head waiting forever; strict order cannot
starve the head, and the head starts as soon as the jobs already running free its slots.
A job that can never fit the cluster (see :func:`can_ever_fit`) is refused at submission, and
:func:`admit` sets such a job aside when given the cluster's totals, so that it never blocks
the queue (e.g. after the cluster lost a node).

GPU quotas (Kueue's ClusterQueue quotas, per user): given ``quotas`` (owner -> GPU slots) and
``held`` (owner -> GPU slots its running jobs hold), a job whose start would take its owner past
the quota stays QUEUED (``over_quota``, with the numbers) and does **not** become the head: it
waits on its owner's own jobs, not on the cluster, so the jobs behind it are considered in order.

Within one call, each admitted job's slots are taken from the free counts before the next job
is considered, and nodes are chosen best-fit (the fullest nodes that still hold a bundle), so
large free nodes stay whole for the wide jobs behind. The caller passes free slots net of the
jobs it admitted earlier whose placement groups Ray has not created yet.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Mapping, Sequence

Slots = Sequence[int] | Mapping[Hashable, int]
"""GPU slots per node: a list (node index -> slots) or a mapping (node id -> slots)."""


@dataclass(frozen=True, kw_only=True)
class QueuedJob:
    """What admission needs to know of a queued job."""

    id: str
    submitted_at: float
    num_nodes: int
    gpus_per_node: int
    priority: int = 0
    owner: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"job {self.id}: resources.{name} must be a positive integer, got {value!r}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class Admission:
    """A job that starts now, and the nodes whose slots it takes (one bundle on each)."""

    job: QueuedJob
    nodes: tuple[Hashable, ...]


@dataclass
class AdmissionPlan:
    """The outcome of one :func:`admit` call.

    Attributes:
        start: the jobs to start now, in queue order.
        waiting: ``(job, why)`` for each job that stays QUEUED, in queue order.
        never_fit: ``(job, refusal)`` for each job larger than the whole cluster (only when
            ``cluster_total`` was given); the caller fails it with that message.
        free: free slots per node once the started jobs hold theirs.
        over_quota: ``(job, why, held)`` for each job that waits on its owner's GPU quota (also in
            ``waiting``); ``held``: the GPU slots its owner's jobs hold, those started in this call included.
    """

    start: list[Admission] = field(default_factory=list)
    waiting: list[tuple[QueuedJob, str]] = field(default_factory=list)
    never_fit: list[tuple[QueuedJob, str]] = field(default_factory=list)
    free: dict[Hashable, int] = field(default_factory=dict)
    over_quota: list[tuple[QueuedJob, str, int]] = field(default_factory=list)


def queue_order(jobs: Iterable[QueuedJob]) -> list[QueuedJob]:
    """Higher priority first, then earlier submission, then job id."""
    return sorted(jobs, key=lambda j: (-j.priority, j.submitted_at, j.id))


def place_gang(job: QueuedJob, free: Slots) -> tuple[Hashable, ...] | None:
    """The ``num_nodes`` distinct nodes that take the job's bundles now, or ``None`` if it cannot start.

    Best fit: among the nodes with at least ``gpus_per_node`` free slots, those with the fewest
    free slots (ties by node order).
    """
    free = _as_dict(free)
    order = {node: i for i, node in enumerate(free)}
    fits = sorted((node for node, n in free.items() if n >= job.gpus_per_node), key=lambda node: (free[node], order[node]))
    return tuple(fits[: job.num_nodes]) if len(fits) >= job.num_nodes else None


def admit(free_slots: Slots, queued: Iterable[QueuedJob], *, cluster_total: Slots | None = None,
          quotas: Mapping[str, int | None] | None = None, held: Mapping[str, int] | None = None) -> AdmissionPlan:
    """Decide which queued jobs start now (gang admission, strict order; see the module docstring).

    Args:
        free_slots: free GPU slots per node now.
        queued: the QUEUED jobs, in any order.
        cluster_total: GPU slots per node when all are free; given, a job that can never fit is
            put in ``never_fit`` instead of blocking the jobs behind it.
        quotas: GPU slots each owner's running jobs may hold together (absent or None: no quota).
        held: GPU slots each owner's running jobs hold now.

    Returns:
        The :class:`AdmissionPlan`.

    Raises:
        ValueError: a negative slot count, or two jobs with one id.
    """
    free = _as_dict(free_slots)
    jobs = list(queued)
    dupes = sorted(i for i, n in Counter(j.id for j in jobs).items() if n > 1)
    if dupes:
        raise ValueError(f"job ids {dupes} are queued more than once; each job must be queued once")
    plan = AdmissionPlan()
    head: QueuedJob | None = None  # the first job that cannot start: everything behind it waits
    held = dict(held or {})
    for job in queue_order(jobs):
        refusal = can_ever_fit(job, cluster_total) if cluster_total is not None else None
        quota = (quotas or {}).get(job.owner) if job.owner is not None else None
        if refusal is not None:
            plan.never_fit.append((job, refusal))
        elif quota is not None and held.get(job.owner, 0) + job.num_gpus > quota:
            why = (f"waits for its owner's GPU quota: {job.owner}'s running jobs hold {held.get(job.owner, 0)} of "
                   f"{quota} GPU slots and this job needs {job.num_gpus}")
            plan.waiting.append((job, why))
            plan.over_quota.append((job, why, held.get(job.owner, 0)))
        elif head is not None:
            plan.waiting.append((job, f"waits behind job {head.id} (priority {head.priority}), which is first "
                                      f"in the queue and waits for GPU slots"))
        elif (nodes := place_gang(job, free)) is None:
            head = job
            plan.waiting.append((job, _shortfall(job, free)))
        else:
            for node in nodes:
                free[node] -= job.gpus_per_node
            if job.owner is not None:
                held[job.owner] = held.get(job.owner, 0) + job.num_gpus
            plan.start.append(Admission(job, nodes))
    plan.free = free
    return plan


def can_ever_fit(job: QueuedJob, cluster_total: Slots) -> str | None:
    """``None`` when the whole cluster, all of it free, could hold the job; else the refusal, with
    what the job needs, what the cluster has and the fix."""
    total = _as_dict(cluster_total)
    if place_gang(job, total) is not None:
        return None
    wide = sum(1 for n in total.values() if n >= job.gpus_per_node)
    largest = max(total.values(), default=0)
    if wide == 0:
        fix = (f"lower resources.gpus_per_node to at most {largest} (raising num_nodes to keep the world size) "
               f"or add nodes with {job.gpus_per_node} GPU slots" if largest else "add GPU nodes to the cluster")
    else:
        fix = (f"lower resources.num_nodes to at most {wide} (and the world size with it) or add nodes with "
               f"{job.gpus_per_node} or more GPU slots")
    return (f"job {job.id} needs {job.num_nodes} node(s) x {job.gpus_per_node} GPU slots = {job.num_gpus} GPU slots "
            f"at once, but the cluster has {_describe(total)}, of which {wide} node(s) hold {job.gpus_per_node} or "
            f"more: it can never start; {fix}")


def _shortfall(job: QueuedJob, free: dict[Hashable, int]) -> str:
    wide = sum(1 for n in free.values() if n >= job.gpus_per_node)
    return (f"needs {job.num_nodes} node(s) with {job.gpus_per_node} free GPU slots each; {wide} node(s) have "
            f"that many free now ({sum(free.values())} free GPU slots in all)")


def _describe(total: dict[Hashable, int]) -> str:
    if not total:
        return "no nodes"
    shapes = Counter(total.values())
    parts = [f"{count} node(s) x {slots} GPU slots" for slots, count in sorted(shapes.items(), reverse=True)]
    return f"{' + '.join(parts)} = {sum(total.values())} GPU slots"


def _as_dict(slots: Slots) -> dict[Hashable, int]:
    out = dict(slots) if isinstance(slots, Mapping) else dict(enumerate(slots))
    bad = {node: n for node, n in out.items() if not isinstance(n, int) or n < 0}
    if bad:
        raise ValueError(f"GPU slot counts must be integers >= 0, got {bad}")
    return out
