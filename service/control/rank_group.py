"""What the job controller drives: the :class:`Launcher` protocol (where a job's ranks run; it
builds one rank group per attempt), the :class:`RankGroup` protocol (the ranks of one attempt,
wherever they run) and :class:`LauncherConfig`, the timeouts and resources a launcher works with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from workers.config import JobConfig
from workers.rank.faults import Fault
from workers.grid import ParallelGrid


@dataclass(frozen=True, kw_only=True)
class LauncherConfig:
    """What a launcher works with: its placement and start-up timeouts, the iterations per call,
    the resources each rank asks for, and how its failures are triaged."""

    placement_timeout_s: float = 120.0
    """How long to wait for the placement group (on a static cluster a job that does not fit
    now never will, so callers that own the cluster pass a short one)."""
    start_timeout_s: float = 600.0
    """Rank start-up (the torch import) plus rendezvous and trainer construction."""
    iterations_per_call: int = 1
    """Iterations per ``run`` call at least: more means fewer round trips, coarser progress."""
    call_target_s: float = 0.0
    """When > 0: each ``run`` call covers about this many seconds of iterations (never past the
    next checkpoint save; see :mod:`service.control.calls`): one driver round trip per call rather
    than per iteration where iterations are short. The Ray launcher sets 1 s."""
    cpus_per_rank: float = 1.0
    """Logical CPUs each Ray rank requests (its bundle holds gpus_per_node of them)."""
    strategy: str = "STRICT_SPREAD"
    """Placement-group strategy: one node per bundle. "PACK" only for a one-machine cluster."""
    static_cluster: bool = False
    """True when no node can join (a cluster started by raytron): a job larger than the cluster's
    total capacity then fails at once instead of after placement_timeout_s."""
    failure_grace_s: float = 3.0
    """After a failure that looks like a consequence (a peer's connection closed, a collective
    timed out), how long to wait for the rank that caused it before naming one."""
    reuse_wait_s: float = 5.0
    """After a failure that leads to a restart: how long the ranks that survived it get to finish
    their call and reset before they are killed too (those that make it start the next attempt
    without a new process)."""


class RankGroup(Protocol):
    """The ranks of one attempt, wherever they run."""

    def start(self, faults: list[Fault]) -> list[dict]:
        """Place, rendezvous, build trainers; returns per-rank placement records (rank order)."""

    def run(self, iterations: int) -> list[list[dict]]:
        """``iterations`` iterations on every rank; per rank, each iteration's metrics."""

    def shutdown(self, keep_warm: bool = False) -> None:
        """Stop every rank and free every resource; safe to call twice or after a failure.
        ``keep_warm``: a restart of the same job follows, so a launcher may keep the ranks that
        survived (processes, placement) for it, until the job's ``release``."""

    def kill(self) -> None:
        """Stop every rank now, from any thread (interrupts a running call)."""


class Launcher(Protocol):
    """Builds the rank group of each attempt (``service.ranks.process_launcher``, ``service.ranks.ray_launcher``)."""

    name: str
    config: LauncherConfig

    def make_group(self, job: JobConfig, grid: ParallelGrid, attempt: int, *, job_id: str) -> RankGroup:
        """The group of attempt ``attempt`` (0-based) for that attempt's job and grid (its size may
        differ after a resize; ``job.checkpoint.resume_from`` is what its ranks load)."""

    def nodes_available(self, gpus_per_node: int) -> int | None:
        """Alive nodes with at least ``gpus_per_node`` GPUs (None: not knowable)."""

    # Optional: ``release(job_id)``, called once the job is terminal, frees what the launcher kept
    # between its attempts (``RankGroup.shutdown(keep_warm=True)``).
