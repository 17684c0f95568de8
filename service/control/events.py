"""Job states and events: the one vocabulary of a job's progress.

A :class:`JobEvent` is what a job store writes, what an event stream sends, what the CLI
renders and what a controller rebuilt after a restart replays; there is no second vocabulary of
progress. :class:`JobState` is the one list of states: the store, the scheduler, the REST API and
(through the API) the console read it from here, as names (:data:`STATES`, ...) where they need
strings.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class JobState(enum.Enum):
    """``QUEUED -> STARTING -> RUNNING -> (RESTARTING -> STARTING -> RUNNING)* -> SUCCEEDED | FAILED | CANCELLED``."""

    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    @property
    def needs_new_attempt(self) -> bool:
        """The ranks are gone and the controller must start them again."""
        return self is JobState.RESTARTING


STATES: tuple[str, ...] = tuple(s.value for s in JobState)
"""Every state's name, in the order a job goes through them."""
TERMINAL_STATES: frozenset[str] = frozenset(s.value for s in JobState if s.is_terminal)
"""The final states: nothing changes a job in one."""
ACTIVE_STATES: tuple[str, ...] = tuple(s.value for s in JobState if not s.is_terminal and s is not JobState.QUEUED)
"""The states of a job whose runner is (or should be) running."""


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's history.

    Attributes:
        time: seconds since the epoch.
        kind: "state" (a transition to ``state``; ``data["from"]`` the previous one),
            "placement" (``data["placement"]``: per-rank records), "iteration" (``data``: that
            iteration's metrics) or "failure" (``data``: the error's ``to_dict()``); "layout" (an
            auto spec's choice, ``service.control.trials.layout_record``: ``chosen`` and the
            ``candidates`` with predicted and, after trials, measured figures).
        state: the job's state when the event happened (the new one for "state").
        message: one human-readable line.
        data: JSON-ready details.
    """

    time: float
    kind: str
    state: JobState
    message: str = ""
    data: dict = field(default_factory=dict)

    @classmethod
    def now(cls, kind: str, state: JobState, message: str = "", data: dict | None = None) -> "JobEvent":
        return cls(time.time(), kind, state, message, data or {})

    def to_dict(self) -> dict:
        """JSON-ready, for a job store or an event stream."""
        return {"time": self.time, "kind": self.kind, "state": self.state.value, "message": self.message,
                "data": self.data}

    @classmethod
    def from_dict(cls, d: dict) -> "JobEvent":
        """The inverse of :meth:`to_dict` (a stored event read back)."""
        return cls(d["time"], d["kind"], JobState(d["state"]), d.get("message", ""), d.get("data") or {})


def retention_message(retention: dict) -> str:
    """One line for a ``checkpoint`` event: the committed checkpoint, what is kept and why, what went."""
    kept = ", ".join(f"{k['iteration']} ({k['why']})" for k in retention["kept"])
    pruned = f"; pruned {', '.join(retention['pruned'])}" if retention["pruned"] else ""
    return f"checkpoint of iteration {retention['iteration']} committed; kept {kept}{pruned}"
