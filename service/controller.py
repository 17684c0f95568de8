"""The per-job controller: an explicit state machine over a group of rank workers.

``QUEUED -> STARTING -> RUNNING -> (RESTARTING -> STARTING -> RUNNING)* -> SUCCEEDED | FAILED |
CANCELLED``. Every transition is a :class:`JobEvent` handed to ``on_event`` *before* it takes
effect, so a job store can persist it first.

The controller knows nothing of Ray (as in Ray Train v2, where the controller drives a worker
group): an attempt asks a :class:`RankGroup` to start (place the ranks, rendezvous, build the
trainers), then to run iterations a few at a time so that progress is visible between calls,
and always to shut down (nothing leaked) before the terminal state is recorded. The Ray
implementation is :class:`service.ray_launcher.RayRankGroup`; tests can step the controller
against a fake one.

A rank failure arrives as a :class:`RankError` naming the rank, its node and pid; the
:class:`FailurePolicy` decides between failing and a new attempt (restarts from checkpoints are
a later issue; the loop already carries the decision out, starting the attempt over).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from service.placement import check_tp_in_node
from workers.config import JobConfig
from workers.grid import ParallelGrid


class JobState(enum.Enum):
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


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's history. ``kind``: "state" (a transition to ``state``), "placement",
    "iteration" (``data`` = that iteration's metrics) or "failure" (``data`` = the error)."""

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


class JobError(RuntimeError):
    """A job could not run to the end. ``code`` is stable (API error codes map to it)."""

    code = "job_error"

    def to_dict(self) -> dict:
        return {"code": self.code, "message": str(self)}


class InsufficientResources(JobError):
    """The job does not fit the cluster (at all, or not within the timeout); the message has needed vs available."""

    code = "insufficient_resources"


class JobCancelled(JobError):
    code = "cancelled"


class RankError(JobError):
    """A rank failed. Carries the rank, where it ran (node index, Ray node id, pid) and the cause."""

    code = "rank_failed"

    def __init__(self, rank: int, where: dict, cause: str, remote_traceback: str = ""):
        self.rank, self.where, self.cause, self.remote_traceback = rank, where, cause, remote_traceback
        at = ", ".join(f"{k} {v}" for k, v in where.items())
        super().__init__(f"rank {rank} ({at}) {self.verb}: {cause}")

    verb = "failed"

    def to_dict(self) -> dict:
        return {**super().to_dict(), "rank": self.rank, **self.where, "cause": self.cause}


class RankDied(RankError):
    """The rank's actor or process died (crash, OOM kill, node loss): a ``RayActorError``."""

    code, verb = "rank_died", "died"


class RankRaised(RankError):
    """The rank raised an exception; ``remote_traceback`` has the rank's traceback."""

    code, verb = "rank_raised", "raised"


class Decision(enum.Enum):
    FAIL = "fail"
    RESTART = "restart"


class FailurePolicy:
    """Decides what a failure leads to (Ray Train v2 style: an injected object returning a decision)."""

    def decide(self, error: JobError, restarts: int) -> Decision:
        raise NotImplementedError


class FailFast(FailurePolicy):
    """Every failure fails the job (restarts from checkpoints come with the fault-tolerance issue)."""

    def decide(self, error: JobError, restarts: int) -> Decision:
        return Decision.FAIL


class RestartUpTo(FailurePolicy):
    """Restart after a rank failure while fewer than ``max_restarts`` restarts happened."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts

    def decide(self, error: JobError, restarts: int) -> Decision:
        return Decision.RESTART if isinstance(error, RankError) and restarts < self.max_restarts else Decision.FAIL


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    placement_timeout_s: float = 120.0
    """How long to wait for the placement group (on a static cluster a job that does not fit
    now never will, so callers that own the cluster pass a short one)."""
    start_timeout_s: float = 600.0
    """Rank start-up (the torch import) plus rendezvous and trainer construction."""
    collective_timeout_s: float = 300.0
    """torch.distributed timeout: a silent peer becomes an error on the others after this."""
    iterations_per_call: int = 1
    """Iterations per ``run`` call: more means fewer round trips, coarser progress."""
    cpus_per_rank: float = 1.0
    """Logical CPUs each rank requests (its bundle holds gpus_per_node of them)."""
    strategy: str = "STRICT_SPREAD"
    """Placement-group strategy: one node per bundle. "PACK" only for a one-machine cluster."""
    static_cluster: bool = False
    """True when no node can join (a cluster started by raytron): a job larger than the cluster's
    total capacity then fails at once instead of after placement_timeout_s."""
    failure_grace_s: float = 5.0
    """When the first rank error looks like a consequence (a peer's connection closed, a
    collective timed out), how long to wait for the rank that caused it before naming one."""


class RankGroup(Protocol):
    """The ranks of one attempt, wherever they run."""

    def start(self, faults: dict[int, tuple[int, str]]) -> list[dict]:
        """Place, rendezvous, build trainers; returns per-rank placement records (rank order)."""

    def run(self, iterations: int) -> list[list[dict]]:
        """``iterations`` iterations on every rank; per rank, each iteration's metrics."""

    def shutdown(self) -> None:
        """Stop every rank and free every resource; safe to call twice or after a failure."""

    def kill(self) -> None:
        """Stop every rank now, from any thread (interrupts a running call)."""


class JobController:
    """Drives one job to a terminal state; :meth:`run` returns the contract-3 result.

    Args:
        job: the job.
        grid: its rank grid.
        job_id: unique id (names the actors, tags the metrics).
        make_group: ``make_group(attempt) -> RankGroup``, called once per attempt.
        on_event: called with every :class:`JobEvent`, synchronously, before it takes effect.
        failure_policy: what a failure leads to; default :class:`FailFast`.
        iterations_per_call: iterations per ``RankGroup.run`` call.
    """

    def __init__(self, job: JobConfig, grid: ParallelGrid, *, job_id: str, make_group: Callable[[int], RankGroup],
                 on_event: Callable[[JobEvent], None] | None = None, failure_policy: FailurePolicy | None = None,
                 iterations_per_call: int = 1):
        self.job, self.grid, self.job_id = job, grid, job_id
        self._make_group, self._on_event = make_group, on_event
        self.policy = failure_policy or FailFast()
        self.iterations_per_call = max(1, iterations_per_call)
        self.events: list[JobEvent] = []
        self.state = JobState.QUEUED
        self.losses: list[float] = []
        self.last_metrics: list[dict] = []
        self.placement: list[dict] = []
        self.restarts = 0
        self.error: JobError | None = None
        self._faults: dict[int, tuple[int, str]] = {}
        self._cancel = threading.Event()
        self._cancel_reason = "cancelled"
        self._group: RankGroup | None = None
        self._emit(JobEvent.now("state", JobState.QUEUED, f"job {job_id}: {grid.world_size} ranks on "
                                f"{job.num_nodes} node(s) x {job.gpus_per_node} GPU(s)"))

    def run(self) -> dict:
        """Run every attempt until a terminal state; returns the contract-3 result object."""
        from service.runner import result_object

        while not self.state.is_terminal:
            try:
                self._attempt()
            except BaseException as exc:  # noqa: BLE001 - every way out must tear down first
                self._shutdown_group()
                self._after_failure(exc)
        result = result_object(self.job_id, self.state.value, self.grid, self.losses, self.placement, self.restarts)
        if self.error is not None:
            result["error"] = str(self.error)
        return result

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the job (thread-safe): the running call is interrupted by killing the ranks."""
        self._cancel_reason = reason
        self._cancel.set()
        group = self._group
        if group is not None:
            group.kill()

    def inject_fault(self, rank: int, iteration: int, kind: str = "raise") -> None:
        """Make ``rank`` fail just before ``iteration`` (1-based): "raise" or "exit" (process dies)."""
        if not 0 <= rank < self.grid.world_size:
            raise ValueError(f"rank {rank} is outside the job's world of {self.grid.world_size} ranks (0..."
                             f"{self.grid.world_size - 1})")
        self._faults[rank] = (iteration, kind)

    def _attempt(self) -> None:
        attempt = f" (attempt {self.restarts + 1})" if self.restarts else ""
        self._transition(JobState.STARTING, "placing ranks" + attempt)
        self._group = self._make_group(self.restarts)
        if self._cancel.is_set():
            raise JobCancelled(self._cancel_reason)
        self.placement = self._group.start(self._faults)
        split = check_tp_in_node(self.grid, {p["rank"]: p["node_id"] for p in self.placement})
        if split:  # the plan keeps them together; this guards the plan -> node mapping end to end
            raise JobError(f"tensor-parallel groups {split} span several nodes")
        self._emit(JobEvent.now("placement", self.state, f"{len(self.placement)} ranks placed",
                                {"placement": self.placement}))
        self._transition(JobState.RUNNING, "training")
        total = self.job.training.train_iters
        while len(self.losses) < total:
            if self._cancel.is_set():
                raise JobCancelled(self._cancel_reason)
            per_rank = self._group.run(min(self.iterations_per_call, total - len(self.losses)))
            self.last_metrics = [m[-1] for m in per_rank]
            for metrics in per_rank[0]:  # the loss is global: every rank returns the same number
                self.losses.append(metrics["loss"])
                self._emit(JobEvent.now("iteration", self.state, "", metrics))
        self._shutdown_group()
        self._transition(JobState.SUCCEEDED, f"{len(self.losses)} iterations")

    def _after_failure(self, exc: BaseException) -> None:
        if self._cancel.is_set() or isinstance(exc, (JobCancelled, KeyboardInterrupt)):
            reason = self._cancel_reason if self._cancel.is_set() else "interrupted"
            self.error = exc if isinstance(exc, JobCancelled) else JobCancelled(reason)
            self._transition(JobState.CANCELLED, reason)
            return
        error = exc if isinstance(exc, JobError) else JobError(f"{type(exc).__name__}: {exc}")
        self._emit(JobEvent.now("failure", self.state, str(error), error.to_dict()))
        if self.policy.decide(error, self.restarts) is Decision.RESTART:
            self.restarts += 1
            self.losses, self.placement = [], []  # no checkpoint yet: the attempt starts over
            self._transition(JobState.RESTARTING, f"restart {self.restarts} after: {error}")
            return
        self.error = error
        self._transition(JobState.FAILED, str(error))

    def _shutdown_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.shutdown()

    def _transition(self, state: JobState, message: str = "") -> None:
        if self.state.is_terminal:
            raise RuntimeError(f"job {self.job_id} is {self.state.value}; cannot go to {state.value}")
        self._emit(JobEvent.now("state", state, message, {"from": self.state.value}))
        self.state = state

    def _emit(self, event: JobEvent) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)
