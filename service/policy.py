"""Failure policies (Ray Train v2 style): injected objects that turn a failure into a decision."""

from __future__ import annotations

import enum

from service.errors import JobError, RankError


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
