"""The per-job controller: an explicit state machine over a group of rank workers.

``QUEUED -> STARTING -> RUNNING -> (RESTARTING -> STARTING -> RUNNING)* -> SUCCEEDED | FAILED |
CANCELLED``. Every transition is a :class:`JobEvent` handed to ``on_event`` *before* it takes
effect, so a job store can persist it first; a controller rebuilt from those events
(``history=``) carries on from where they end.

The controller knows nothing of Ray or processes (as in Ray Train v2, where the controller
drives a worker group): an attempt asks a :class:`RankGroup` to start (place the ranks,
rendezvous, build the trainers), then to run iterations a few at a time so that progress is
visible between calls, and always to shut down (nothing leaked) before the next state is
recorded. The launchers (``service/ranks/process_launcher.py``, ``service/ranks/ray_launcher.py``) build
the groups; tests step the controller against a fake one.

A rank failure arrives as a :class:`~service.control.errors.RankError` naming the rank, its node, pid
and coordinates; the :class:`~service.control.policy.FailurePolicy` (by default
``fault_tolerance.max_restarts``) decides between failing and a new attempt.

Each attempt starts from the latest complete checkpoint under ``checkpoint.dir`` (else
``checkpoint.load``, else the seed): the controller names it in the attempt's STARTING event
(``data["from_checkpoint"]``), its ranks load it, and the controller keeps the metrics of the
iterations up to it, so ``losses`` stays the whole curve. An attempt restored from memory
(``fault_tolerance.memory_interval``) may go on from an iteration the failed call finished but
never returned: rank 0's placement record carries those iterations' metrics (``caught_up``),
recorded before the attempt runs. Before an attempt a
:class:`~service.control.sizing.Sizer` sizes it from the nodes the cluster offers
(``nodes_available``) with the :class:`~service.control.policy.ScalingPolicy`: a lost node that does not come back within ``node_grace_s`` shrinks dp
(a "resize" event), and a shrunk job grows back at its next checkpoint once nodes return.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable

from service.control.calls import CallSizer
from service.control.errors import JobCancelled, JobError
from service.control.events import JobEvent, JobState
from service.control.relayout import ElasticRelayout
from service.control.trials import layout_message
from service.control.recovery import restore_event, resume_source
from service.control.preemption import PreemptionWatch, count_preemptions, preempted_event, save_before_leaving
from service.control.outcome import Outcome, judge, outcome_transition
from service.control.policy import Decision, ElasticDataParallel, FailurePolicy, RestartUpTo, ScalingPolicy
from service.control.rank_group import RankGroup
from service.control.record import (checkpoint_event, count_restarts, is_restart, iteration_events, placement_event,
                                    queued_message, replay, resize_event, starting_transition)
from service.control.result import result_object
from service.control.sizing import Sizer
from workers.config import JobConfig
from workers.rank.faults import Fault, check_ranks
from workers.grid import ParallelGrid

class JobController:
    """Drives one job to a terminal state; :meth:`run` returns the job's result (:mod:`service.control.result`).

    Args:
        job: the job.
        grid: its rank grid.
        job_id: unique id (names the actors, tags the metrics).
        make_group: ``make_group(attempt, job, grid) -> RankGroup``, called once per attempt
            with that attempt's job (its size, the checkpoint to resume from) and grid.
        on_event: called with every :class:`JobEvent`, synchronously, before it takes effect.
        failure_policy: default :class:`RestartUpTo` ``(job.max_restarts)``.
        iterations_per_call: iterations per ``RankGroup.run`` call, at least.
        call_target_s: when > 0, each call covers about this many seconds of iterations, never
            past the next checkpoint save (:class:`~service.control.calls.CallSizer`).
        faults: failure drills; each fires once, in the first attempt that reaches its iteration.
        history: events of this job recorded earlier (a rebuilt controller replays them instead
            of starting over at QUEUED).
        nodes_available: how many nodes of ``gpus_per_node`` the cluster offers now (None:
            unknown, the launcher waits for its placement as usual).
        scaling_policy: default :class:`ElasticDataParallel`, or :class:`ElasticRelayout` for a job
            with ``fault_tolerance.relayout_on_resize``.
        release: called once when the job is terminal, to free what the launcher kept between
            attempts (ranks kept warm for a restart).
        layout: the record of an auto layout's choice (``parallel: auto``), emitted as a ``layout``
            event after QUEUED.
        drain_notices: node id -> deadline of the nodes being drained (a preemption notice), asked
            between calls (:mod:`service.control.preemption`); None: never.
    """

    def __init__(self, job: JobConfig, grid: ParallelGrid, *, job_id: str,
                 make_group: Callable[[int, JobConfig, ParallelGrid], RankGroup],
                 on_event: Callable[[JobEvent], None] | None = None, failure_policy: FailurePolicy | None = None,
                 iterations_per_call: int = 1, call_target_s: float = 0.0, faults: list[Fault] | tuple = (),
                 history: list[JobEvent] | None = None, nodes_available: Callable[[], int | None] | None = None,
                 scaling_policy: ScalingPolicy | None = None, release: Callable[[], None] | None = None,
                 layout: dict | None = None, drain_notices: Callable[[], dict] | None = None):
        self.job, self.grid, self.job_id = job, grid, job_id
        self.current = job  # this attempt's job: its size may differ after a resize
        self.sizer = Sizer(job, scaling_policy or (ElasticRelayout() if job.relayout_spec else ElasticDataParallel()),
                           nodes_available)
        self._make_group, self._on_event, self._release = make_group, on_event, release
        self.policy = failure_policy or RestartUpTo(job.max_restarts)
        self.preemption = PreemptionWatch(drain_notices)
        # Calls end where a restart from disk can resume (an in-memory restore also takes back the
        # iterations a failed call finished: workers.rank.replicas).
        self.calls = CallSizer(max(1, iterations_per_call), call_target_s, job.checkpoint.save_interval or None)
        check_ranks(faults, grid.world_size)
        self.faults = list(faults)
        self.events: list[JobEvent] = []
        self.state = JobState.QUEUED
        self.metrics: list[dict] = []  # rank 0's metrics per iteration, over every attempt (the whole curve)
        self.iteration = 0  # the last finished iteration
        self.attempts = 0  # attempts started by this controller
        self.placement: list[dict] = []
        self.restarts = 0  # the events so far that count as one (is_restart), kept by _emit and _replay
        self.error: JobError | None = None
        self._cancel = threading.Event()
        self._cancel_reason = "cancelled"
        self._group: RankGroup | None = None
        self._thread: threading.Thread | None = None
        self._result: dict | None = None
        self.done = threading.Event()
        if history:
            self._replay(history)
        else:
            self._emit(JobEvent.now("state", JobState.QUEUED, queued_message(job, grid, job_id)))
            if layout:  # an auto layout: what was chosen, among what (service.control.trials.layout_record)
                self._emit(JobEvent.now("layout", JobState.QUEUED, layout_message(layout), layout))

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def run(self) -> dict:
        """Run every attempt until a terminal state; returns the job's result object (what ``raytron run --json`` prints)."""
        try:
            while not self.state.is_terminal:
                try:
                    self._attempt()
                except BaseException as exc:  # noqa: BLE001 - every way out must tear down first
                    outcome, error = self._judge(exc)
                    # A restart of the same size may start again on the ranks that survived.
                    self._shutdown_group(keep_warm=outcome is Outcome.RESTART)
                    self._after_failure(outcome, error)
            self._result = self.result()
            return self._result
        finally:
            if self._release is not None:
                self._release()
            self.done.set()

    def start(self) -> "JobController":
        """Run in a background thread; :meth:`wait` for the result."""
        self._thread = threading.Thread(target=self.run, name=f"raytron-job-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> dict | None:
        """The result once the job is terminal, or None if ``timeout`` passed first."""
        return self._result if self.done.wait(timeout) else None

    def result(self) -> dict:
        return result_object(self.job_id, self.state.value, self.grid, self.metrics, self.placement,
                             self.restarts, None if self.error is None else str(self.error))

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the job (thread-safe): the running call is interrupted by killing the ranks."""
        self._cancel_reason = reason
        self._cancel.set()
        group = self._group
        if group is not None:
            group.kill()

    def _attempt(self) -> None:
        job = self.job if self.attempts == 0 else self.sizer.next_size(self.current, self._cancel.wait)
        if job is None:
            raise JobCancelled(self._cancel_reason)
        self.attempts += 1
        if self.attempts > 1 and (waiting := self.sizer.waiting_event(job, self.state)) is not None:
            self._emit(waiting)
        grid = ParallelGrid.from_config(job.parallel, job.world_size)
        if grid.world_size != self.grid.world_size:
            self._emit(resize_event(self.state, self.current, self.grid, job, grid))
        self.current, self.grid = job, grid
        source = self._resume_source()
        job = replace(job, checkpoint=replace(job.checkpoint, resume_from=source), memory_upto=len(self.metrics))
        self._transition(JobState.STARTING, *starting_transition(self.events, source, job, grid))
        self._group = self._make_group(self.restarts, job, grid)
        if self._cancel.is_set():
            raise JobCancelled(self._cancel_reason)
        self.placement = self._group.start([f for f in self.faults if f.rank < grid.world_size])
        start = int(self.placement[0].get("resumed_iteration") or 0) if self.placement else 0
        caught_up = [p.pop("caught_up", None) for p in self.placement][0] if self.placement else None
        self.iteration = len(self.metrics)
        for metrics in (caught_up or [])[: max(0, start - self.iteration)]:
            self._record(metrics)  # finished in the failed call, restored from memory: not run again
        del self.metrics[start:]  # iterations after the checkpoint are run again
        self.iteration = start
        # the Ray launcher's hot spares beside the ranks
        self._emit(placement_event(self.state, self.grid, self.placement, getattr(self._group, "placement_extra", dict)))
        if job.memory_interval and self.attempts > 1:
            self._emit(restore_event(self.state, start, source, self.placement))
        self._transition(JobState.RUNNING, "training")
        self.calls.new_attempt()
        total = self.job.training.train_iters
        while self.iteration < total:
            if self._cancel.is_set():
                raise JobCancelled(self._cancel_reason)
            n = self.calls.size(self.iteration, total - self.iteration, alone={f.iteration for f in self.faults})
            t0 = time.monotonic()
            per_rank = self._group.run(n)
            self.calls.measured(n, time.monotonic() - t0)
            for metrics in per_rank[0]:  # global metrics: every rank returns the same numbers
                self._record(metrics)
            sigterms = getattr(self._group, "notices", None)  # ranks that got a SIGTERM (local processes)
            notice = (self.preemption.check(self.placement, sigterms() if sigterms else None)
                      if self.iteration < total else None)
            if notice is not None:
                return self._preempt(notice)
            if self.iteration < total and self.sizer.should_grow(self.current, self.iteration):
                self._shutdown_group()
                self._transition(JobState.RESTARTING, f"nodes returned: growing back to {self.job.num_nodes} "
                                 f"node(s) from the checkpoint of iteration {self.iteration}", {"resize": True})
                return
        self._shutdown_group()
        self._transition(JobState.SUCCEEDED, f"{len(self.metrics)} iterations")

    def _record(self, metrics: dict) -> None:
        """Record the next iteration from its (rank 0's) metrics; raises on a non-finite loss."""
        self.iteration += 1
        events = iteration_events(self.state, self.iteration, metrics)
        self.metrics.append(metrics)
        for event in events:
            self._emit(event)

    def _preempt(self, notice) -> None:
        """Nodes holding ranks are being drained: save this iteration, leave them, record PREEMPTED."""
        saved = save_before_leaving(self._group)
        self._shutdown_group()
        retention = saved.pop("retention", None)
        if retention is not None:
            self._emit(checkpoint_event(self.state, retention))
        number, limit = count_preemptions(self.events) + 1, self.job.max_preemptions
        self._emit(preempted_event(self.state, notice, saved, self._resume_source(), number, limit))
        if number > limit:
            self.error = JobError(f"preempted {number} times; fault_tolerance.max_preemptions is {limit}")
            self._transition(JobState.FAILED, str(self.error))
        else:
            self._transition(JobState.RESTARTING, f"moving off the node(s) being preempted from iteration {self.iteration}",
                             {"preempted": True, "nodes": list(notice.nodes)})

    def _judge(self, exc: BaseException) -> tuple[Outcome, JobError]:
        """What a failed attempt leads to (decided before the teardown, which it shapes)."""
        return judge(exc, cancel_reason=self._cancel_reason if self._cancel.is_set() else None,
                     fewer_nodes=lambda: self.sizer.fewer_nodes_now(self.current),
                     restart=lambda error: self.policy.decide(error, self.restarts) is Decision.RESTART)

    def _after_failure(self, outcome: Outcome, error: JobError) -> None:
        if outcome in (Outcome.RESTART, Outcome.FAIL):
            # A drill fires once: those at or before the iteration that failed are spent.
            reached = self.iteration + 1
            self.faults = [f for f in self.faults if f.iteration > reached]
        if outcome is not Outcome.CANCEL:
            self._emit(JobEvent.now("failure", self.state, str(error), error.to_dict()))
        if outcome in (Outcome.CANCEL, Outcome.FAIL):
            self.error = error
        self._transition(*outcome_transition(outcome, error, self.restarts))

    def _shutdown_group(self, keep_warm: bool = False) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.shutdown(keep_warm=keep_warm)

    def _transition(self, state: JobState, message: str = "", data: dict | None = None) -> None:
        if self.state.is_terminal:
            raise RuntimeError(f"job {self.job_id} is {self.state.value}; cannot go to {state.value}")
        self._emit(JobEvent.now("state", state, message, {"from": self.state.value, **(data or {})}))
        self.state = state

    def _emit(self, event: JobEvent) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)
        self.restarts += is_restart(event)

    def _replay(self, history: list[JobEvent]) -> None:
        """Take the state, metrics, placement and restarts the recorded events end with.

        A job that was STARTING or RUNNING when its events stopped has lost its ranks; its
        next :meth:`run` starts a new attempt from its latest checkpoint. A drill (``faults``)
        that the recorded attempts reached has had its one chance, as in :meth:`_after_failure`:
        those at or before a recorded failure's iteration, or before the last recorded one, are spent.
        """
        self.restarts = count_restarts(history)
        self.events.extend(history)
        r = replay(history)
        self.state, self.metrics, self.placement, self.error = r.state, r.metrics, r.placement, r.error
        self.iteration = len(self.metrics)
        self.faults = [f for f in self.faults if f.iteration > r.spent]
        if self.state in (JobState.STARTING, JobState.RUNNING):
            # a restart like any other: _emit counts it (and so does a later replay of it)
            self._transition(JobState.RESTARTING, "the controller was restarted; the ranks are gone")

    def _resume_source(self) -> str | None:
        return resume_source(self.job.checkpoint, len(self.metrics))
