"""Experiment trackers: one run per job and tracker (MLflow, W&B), fed from the job's events.

Whoever records a job's events (the runner of ``raytron serve``, ``raytron run``) passes each one,
after recording it, to :class:`Tracking`, which hands it to a background thread per tracker, so the
job never waits on a tracker. The trackers' runs are :mod:`service.control.tracker_runs`:

* ``iteration`` events: the metrics TensorBoard gets (:data:`METRICS`) at their iteration as the
  step. A step the run has already logged (an attempt that went on from a checkpoint runs some
  iterations again, to the same values) is not logged twice, so the run's history is the job's curve.
* every other event but placements (states, restarts, resizes, checkpoints, failures): a note
  ``raytron.event.<ms>.<kind>`` holding the job's state and the event's message (an MLflow tag, a
  W&B summary entry). Keys are unique: an event in the same millisecond as the one before it gets
  the next millisecond.
* at the end, the run is ended with the job's final state.

The run is found again by the job's id (MLflow: its tag ``raytron.job_id``; W&B: its run id): a
restarted attempt, a resized job and a new runner after a server restart all log into the job's one
run, never a new one per attempt. The spec is the run's parameters (MLflow) or config (W&B).

A tracker that cannot be reached does not fail the job: its deliveries are retried in the
background (backoff up to 10 s) and a ``tracking`` event says it is unreachable, and another that
it is reachable again; what is still undelivered when the job ends gets ``close``'s grace period
(10 s; the runner's environment variable ``RAYTRON_TRACKING_CLOSE_GRACE_S`` sets another, in seconds),
then is dropped and counted in a last event. The first ``tracking`` event of a run carries its id
and address (the console links to it).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from typing import Callable

from service.control.events import JobEvent, JobState
from service.control.tracker_runs import tracker_runs

METRICS = ("loss", "val_loss", "lr", "grad_norm", "loss_scale", "moe_aux_loss", "mtp_loss", "tokens_per_s",
           "step_time_s", "peak_mem_mb", "skipped")
MAX_BACKOFF_S = 10.0
CLOSE_GRACE_ENV = "RAYTRON_TRACKING_CLOSE_GRACE_S"


def close_grace_s() -> float:
    """How long ``close`` waits for undelivered items: 10 s, or ``RAYTRON_TRACKING_CLOSE_GRACE_S``."""
    raw = os.environ.get(CLOSE_GRACE_ENV, "").strip()
    try:
        value = float(raw) if raw else 10.0
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError(f"{CLOSE_GRACE_ENV}={raw!r} is no number of seconds (0 or more): set e.g. 10, or unset it")
    return value


class _Delivery(threading.Thread):
    """One tracker's queue, delivered in order by a daemon thread; a failure is retried."""

    def __init__(self, run, emit: Callable[[str, dict], None]):
        super().__init__(daemon=True, name=f"raytron-tracking-{run.name}")
        self.run_, self.emit = run, emit
        self.items: queue.Queue = queue.Queue()
        self.deadline: float | None = None  # set by close: give up on an item after it
        self.failing = False
        self.dropped = 0

    def run(self) -> None:
        while (item := self.items.get()) is not None:
            self._deliver(item)

    def _deliver(self, item: tuple) -> None:
        delay = 0.5
        while True:
            try:
                opened = self.run_.open()
                if opened is not None:
                    self.emit(f"{self.run_.where}: {'resumed' if opened['resumed'] else 'created'} run "
                              f"{opened['run_id']}", opened)
                getattr(self.run_, item[0])(*item[1:])
                if self.failing:
                    self.failing = False
                    self.emit(f"{self.run_.where} is reachable again; the deliveries go on",
                              {"tracker": self.run_.name, "reachable": True})
                return
            except Exception as e:  # noqa: BLE001 - any failure of the tracker: the job goes on
                if not self.failing:
                    self.failing = True
                    self.emit(f"{self.run_.where} is unreachable ({type(e).__name__}: {str(e)[:300]}); retrying "
                              f"in the background, the job goes on", {"tracker": self.run_.name, "reachable": False})
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self.dropped += 1
                    return
                time.sleep(delay if self.deadline is None else min(delay, max(0.0, self.deadline - time.monotonic())))
                delay = min(delay * 2, MAX_BACKOFF_S)


class Tracking:
    """``on_event`` wrapper: records each event with ``record`` (under a lock it shares with the
    trackers' own ``tracking`` events), then queues it for each tracker."""

    def __init__(self, record: Callable[[JobEvent], None], runs: list, state: str = JobState.QUEUED.value):
        self.record, self.lock = record, threading.Lock()
        self.grace_s = close_grace_s()  # read before the job starts: a bad value stops it there
        self.state = JobState(state)  # the job's state now: the tracker's own events carry it
        self.deliveries = [_Delivery(run, self._emit) for run in runs]
        self._note_ms = 0  # the last note's key time: keys strictly increase, one per event
        for d in self.deliveries:
            d.start()

    @classmethod
    def of(cls, spec: dict, job_id: str, record: Callable[[JobEvent], None], state: str = JobState.QUEUED.value,
           history: list[JobEvent] | None = None) -> "Tracking | Callable[[JobEvent], None]":
        """``record`` itself for a spec (a validated spec's dict) without trackers, else a
        :class:`Tracking` over it. A runner that goes on from a job's record passes its ``state``
        and ``history``: the recorded events are delivered first, so what a lost runner recorded
        but had not delivered yet reaches the run (a step already logged is skipped)."""
        runs = tracker_runs(spec, job_id)
        if not runs:
            return record
        tracking = cls(record, runs, state)
        for event in history or ():
            tracking.deliver(event)
        return tracking

    def _emit(self, message: str, data: dict) -> None:
        with self.lock:
            self.record(JobEvent.now("tracking", self.state, message, data))

    def __call__(self, event: JobEvent) -> None:
        with self.lock:
            self.record(event)
            if event.kind == "state":
                self.state = event.state
        self.deliver(event)

    def deliver(self, event: JobEvent) -> None:
        """Queue an event for the trackers without recording it (a recorded one: see :meth:`of`)."""
        if event.kind == "iteration":
            step, values = event.data.get("iteration"), _numbers(event.data)
            item = ("metrics", step, values) if isinstance(step, int) and values else None
        elif event.kind in ("placement", "tracking"):
            item = None
        else:
            # Two events in one millisecond (a failure, RESTARTING and STARTING often are) each keep
            # their note: the key's time moves on by 1 ms. A replayed history gets the same keys.
            with self.lock:
                self._note_ms = max(int(event.time * 1000), self._note_ms + 1)
                key = f"raytron.event.{self._note_ms}.{event.kind}"
            item = ("note", key, f"{event.state.value}: {event.message}")
        if item is not None:
            for d in self.deliveries:
                d.items.put(item)

    def close(self, final_state: str, grace_s: float | None = None) -> None:
        """End each run with the job's final state; wait up to ``grace_s`` (default :func:`close_grace_s`) for
        what is queued."""
        deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        for d in self.deliveries:
            d.items.put(("end", final_state))
            d.items.put(None)
            d.deadline = deadline
        for d in self.deliveries:
            d.join(max(0.0, deadline - time.monotonic()) + 1.0)
            left = d.dropped + d.items.qsize()
            if left:
                self._emit(f"{d.run_.where}: {left} deliveries not made before the job ended",
                           {"tracker": d.run_.name, "undelivered": left})


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(metrics[k]) for k in METRICS
            if isinstance(metrics.get(k), (int, float)) and math.isfinite(float(metrics[k]))}
