"""Failure and scaling policies (Ray Train v2 style): injected objects that turn a failure, or the
nodes a cluster offers, into a decision."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from service.control.errors import JobError, RankError
from service.spec.spec import batch_problem
from workers.config import JobConfig, ParallelConfig
from workers.grid import ParallelGrid


class Decision(enum.Enum):
    FAIL = "fail"
    RESTART = "restart"


class FailurePolicy:
    """Decides what a failure leads to."""

    def decide(self, error: JobError, restarts: int) -> Decision:
        raise NotImplementedError


class FailFast(FailurePolicy):
    """Every failure fails the job."""

    def decide(self, error: JobError, restarts: int) -> Decision:
        return Decision.FAIL


class RestartUpTo(FailurePolicy):
    """A new attempt after a rank failure while fewer than ``max_restarts`` restarts happened
    (``fault_tolerance.max_restarts``). Other errors (no fit, non-finite loss) fail at once."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts

    def decide(self, error: JobError, restarts: int) -> Decision:
        return Decision.RESTART if isinstance(error, RankError) and restarts < self.max_restarts else Decision.FAIL


@dataclass(frozen=True)
class ScalingDecision:
    """What the next attempt runs on: ``num_nodes`` nodes (None: the job cannot run; ``reason`` says why),
    in the job's own layout or, when ``parallel`` is given, in that one (a re-pick:
    :mod:`service.control.relayout`)."""

    num_nodes: int | None
    sizes: dict | None = None
    reason: str = ""
    parallel: ParallelConfig | None = None


class ScalingPolicy:
    """Decides the size of the next attempt from the nodes the cluster offers."""

    def decide(self, job: JobConfig, available_nodes: int) -> ScalingDecision:
        raise NotImplementedError


class ElasticDataParallel(ScalingPolicy):
    """Megatron-style elastic data parallelism (Ray Train v2's scaling policy, as a pure function).

    tp, pp, cp, ep (and etp, vpp, order) stay; the job runs on the most nodes it may have, at
    most ``resources.num_nodes`` and at least ``resources.min_nodes``, such that the grid is
    valid, dp divides the global batch into whole microbatches and the interleaved schedule's
    rule holds. The trainer then runs ``global_batch / (micro_batch x dp)`` microbatches, so
    the global batch and the loss curve do not change.
    """

    def decide(self, job: JobConfig, available_nodes: int) -> ScalingDecision:
        floor = job.min_nodes or job.num_nodes
        problems = []
        for n in range(min(job.num_nodes, available_nodes), floor - 1, -1):
            try:
                grid = ParallelGrid.from_config(job.parallel, n * job.gpus_per_node)
            except ValueError as e:
                problems.append(f"{n} node(s): {e}")
                continue
            problem = batch_problem(job.training.global_batch_size, job.training.micro_batch_size, grid)
            if problem:
                problems.append(f"{n} node(s): {problem}")
                continue
            return ScalingDecision(n, grid.sizes())
        why = f"; ".join(problems[-2:]) if problems else "no node count in range"
        return ScalingDecision(None, None, f"{available_nodes} node(s) of {job.gpus_per_node} GPU(s) available, "
                                           f"resources.min_nodes {floor}: no valid size ({why})")


def resized(job: JobConfig, num_nodes: int, parallel: ParallelConfig | None = None) -> JobConfig:
    """``job`` on ``num_nodes`` nodes (world size follows), in ``parallel`` when given; everything else stays."""
    return replace(job, num_nodes=num_nodes, world_size=num_nodes * job.gpus_per_node,
                   parallel=parallel or job.parallel)
