"""What a failed attempt leads to (cancel, resize, restart or fail) and the state each records.

:class:`~service.control.controller.JobController` judges every way out of an attempt here before
it tears the attempt down (the teardown depends on it: a restart of the same size may keep the
surviving ranks warm), then records the outcome's transition. Pure: the controller passes what
the cluster and the failure policy say.
"""

from __future__ import annotations

import enum
from typing import Callable

from service.control.errors import InsufficientResources, JobCancelled, JobError
from service.control.events import JobState


class Outcome(enum.Enum):
    """What a failed attempt leads to."""

    CANCEL = "cancel"
    RESIZE = "resize"  # fewer nodes than the attempt waited for: size again (not a restart)
    RESTART = "restart"
    FAIL = "fail"


def judge(exc: BaseException, *, cancel_reason: str | None, fewer_nodes: Callable[[], bool],
          restart: Callable[[JobError], bool]) -> tuple[Outcome, JobError]:
    """The outcome of an attempt that ended with ``exc``, and the job's error.

    Args:
        cancel_reason: the reason of a cancel asked for (None: none was).
        fewer_nodes: whether the cluster offers fewer nodes than the attempt needs now (asked
            only for :class:`InsufficientResources`).
        restart: the failure policy: whether ``error`` gets a new attempt.
    """
    if cancel_reason is not None or isinstance(exc, (JobCancelled, KeyboardInterrupt)):
        return Outcome.CANCEL, JobCancelled(cancel_reason if cancel_reason is not None else "interrupted")
    error = exc if isinstance(exc, JobError) else JobError(f"{type(exc).__name__}: {exc}")
    if isinstance(error, InsufficientResources) and fewer_nodes():
        return Outcome.RESIZE, error
    if restart(error):
        return Outcome.RESTART, error
    return Outcome.FAIL, error


def outcome_transition(outcome: Outcome, error: JobError, restarts: int) -> tuple[JobState, str, dict | None]:
    """The state an outcome moves the job to, with the transition's message and data (``restarts``:
    the job's restarts so far). Every outcome but a cancel records a ``failure`` event first."""
    if outcome is Outcome.CANCEL:
        return JobState.CANCELLED, str(error), None
    if outcome is Outcome.RESIZE:
        # A node was lost while the attempt waited for its placement: size again, not a restart.
        return JobState.RESTARTING, f"fewer nodes than the attempt needs: {error}", {"resize": True}
    if outcome is Outcome.RESTART:
        return JobState.RESTARTING, f"restart {restarts + 1} after: {error}", None
    return JobState.FAILED, str(error), None
