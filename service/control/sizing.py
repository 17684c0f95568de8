"""How many nodes each attempt of a job runs on: the elastic part of the controller.

A :class:`Sizer` applies the job's :class:`~service.control.policy.ScalingPolicy` to the nodes the cluster
offers (``nodes_available``, from the launcher): after a lost node that stays away
``fault_tolerance.node_grace_s`` the next attempt shrinks (never below ``resources.min_nodes``), and
a shrunk job grows back right after a checkpoint once nodes return. A job without ``min_nodes``
below ``num_nodes`` always runs at full size (and waits for its placement as usual).
"""

from __future__ import annotations

import time
from typing import Callable

from service.control.errors import InsufficientResources
from service.control.events import JobEvent, JobState
from service.control.policy import ScalingPolicy, resized
from workers.config import JobConfig


class Sizer:
    """The sizes of one job's attempts.

    Args:
        job: the job as submitted (its full size).
        scaling: the policy that turns available nodes into a size.
        nodes_available: nodes of ``gpus_per_node`` GPUs the cluster offers now (None, or a
            callable returning None: not knowable, the job keeps its size).
    """

    def __init__(self, job: JobConfig, scaling: ScalingPolicy,
                 nodes_available: Callable[[], int | None] | None = None):
        self.job, self.scaling, self._nodes_available = job, scaling, nodes_available
        self.elastic = (job.min_nodes or job.num_nodes) < job.num_nodes

    def available(self) -> int | None:
        return None if self._nodes_available is None else self._nodes_available()

    def next_size(self, current: JobConfig, cancelled: Callable[[float], bool]) -> JobConfig | None:
        """The job the next (not first) attempt runs: full size when the nodes are there; after a
        lost node that stays away node_grace_s, what the scaling policy decides. ``cancelled(s)``
        waits up to s seconds and says whether the job was cancelled (then None)."""
        available = self.available()
        if not self.elastic or available is None or available >= self.job.num_nodes:
            return self.job
        deadline = time.monotonic() + self.job.node_grace_s
        while available < current.num_nodes and time.monotonic() < deadline:
            if cancelled(0.5):
                return None
            available = self.available() or 0
        if available >= self.job.num_nodes:
            return self.job
        decision = self.scaling.decide(self.job, available)
        if decision.num_nodes is None:
            raise InsufficientResources(decision.reason)
        return resized(self.job, decision.num_nodes, decision.parallel)

    def fewer_nodes_now(self, current: JobConfig) -> bool:
        """An elastic job whose cluster now offers fewer nodes than ``current`` (the attempt) wanted."""
        if not self.elastic:
            return False
        available = self.available()
        if available is None or available >= current.num_nodes:
            return False
        return self.scaling.decide(self.job, available).num_nodes is not None

    def should_grow(self, current: JobConfig, iteration: int) -> bool:
        """A shrunk job grows back right after a checkpoint once more nodes are there."""
        interval = self.job.checkpoint.save_interval
        if current.num_nodes >= self.job.num_nodes or not interval or iteration % interval:
            return False
        available = self.available() or 0
        return self.scaling.decide(self.job, available).num_nodes not in (None, current.num_nodes)

    def waiting_event(self, job: JobConfig, state: JobState) -> JobEvent | None:
        """An attempt that needs more nodes than the cluster offers now waits for its placement (a job
        that may not shrink, or not below its size): the ``waiting`` event that says so, with the numbers."""
        available = self.available()
        if available is None or available >= job.num_nodes:
            return None
        why = ("resources.min_nodes is not below num_nodes, so the job does not shrink" if not self.elastic
               else f"the job does not shrink below resources.min_nodes {job.min_nodes}")
        return JobEvent.now("waiting", state, f"{available} of the {job.num_nodes} node(s) with {job.gpus_per_node} "
                            f"GPU(s) the attempt needs are available: waiting for a replacement ({why})",
                            {"available": available, "needed": job.num_nodes})
