"""The server loop: submit -> QUEUED; admit by gang; launch; watch the runners; recover after a restart.

A :class:`Scheduler` owns no job state of its own: the store is the record (jobs, events) and
the runner each back end starts writes the job's events there. The scheduler only

* stores a submitted job QUEUED, refusing one that can never fit the cluster (:class:`NeverFits`);
* admits within each user's GPU quota (``quota_of(owner)``): a job that would take its owner past
  it waits QUEUED, with a ``"waiting"`` event saying so (once per reason), and the jobs behind it
  go on in order (:func:`service.server.queue.admit`);
* in a background thread, admits queued jobs with :func:`service.server.queue.admit` against the free
  GPU slots (the cluster's slots minus those held by the jobs it launched), records the
  admission (an ``"admission"`` event naming the nodes, so a restarted server knows which slots
  are held) and asks the runner back end to start the runner;
* notices a runner that ended without a final state (killed, crashed, lost with its node) and
  starts a new runner for the job (a ``"runner"`` event says so), which goes on from the job's
  record: the store's events are replayed into its controller, so the lost attempt counts as a
  restart under ``fault_tolerance.max_restarts`` and the job resumes from its latest recorded
  checkpoint with the curve whole; FAILED once the restarts are spent, CANCELLED when a cancel
  was asked;
* on start, re-attaches to the runners of jobs that were running when a previous server
  stopped, and starts a new runner for those whose runner is gone, as above (a job admitted
  whose runner never recorded anything is queued again: nothing of it ran).

Nothing here prints; ``logging`` carries what an operator may want to see.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable

from service.control.events import ACTIVE_STATES, TERMINAL_STATES, JobEvent, JobState
from service.server.cluster_view import ClusterView, NodeSlots, StaticCluster  # noqa: F401 (re-exported)
from service.server.held_slots import HeldSlots, free_slots
from service.server.runners import JobRunners
from service.server.queue import QueuedJob, admit, can_ever_fit
from service.server.runner_restarts import new_runner_event
from service.spec.spec import JobSpec
from service.spec.stored import stored_section
from service.server.store import BOOTSTRAP_ADMIN, InvalidTransition, JobStore, UnknownJob

log = logging.getLogger("raytron.scheduler")


class NeverFits(ValueError):
    """The job needs more than the whole cluster (HTTP 409); the message has needed vs available."""


class JobNotActive(ValueError):
    """A cancel of a job that has already ended (HTTP 409)."""


def queued_job(row: dict) -> QueuedJob:
    res = stored_section(row["spec"], "resources")
    return QueuedJob(id=row["id"], submitted_at=row["submitted_at"], priority=row["priority"],
                     num_nodes=res.num_nodes + res.spare_nodes, gpus_per_node=res.gpus_per_node,
                     owner=row.get("owner"))  # hot spares hold nodes of their own


class Scheduler:
    """Admission, launching and supervision of jobs (see the module docstring).

    Args:
        store: the job store.
        runners: starts and stops runners.
        cluster: the cluster's nodes and slots.
        poll_s: how often the loop looks at runners and the queue (a submit, a cancel or a runner's exit,
            where the back end tells of it, wakes it at once).
        vanish_grace_s: a runner that exited after a cancel is given this long for its last events to
            land (it may still be stopping its ranks when its back end reports it gone) before the
            scheduler records a final state for it.
        exit_grace_s: the same for a runner that exited uncancelled (killed, crashed): its process has
            ended, so what it wrote has landed; the short wait only lets a final state it recorded be
            read before a new runner is started.
        quota_of: ``quota_of(owner)``: the GPU slots the owner's running jobs may hold together (None: no quota).
    """

    def __init__(self, store: JobStore, runners: JobRunners, cluster: ClusterView, *, poll_s: float = 0.5,
                 vanish_grace_s: float = 2.0, exit_grace_s: float = 0.5,
                 quota_of: Callable[[str], int | None] | None = None):
        self.store, self.runners, self.cluster = store, runners, cluster
        self.quota_of = quota_of or (lambda owner: None)
        self._quota_noted: dict[str, str] = {}  # queued job -> the quota reason last recorded
        self.poll_s, self.vanish_grace_s, self.exit_grace_s = poll_s, vanish_grace_s, min(exit_grace_s, vanish_grace_s)
        self._look_at: float | None = None  # when a runner's grace ends: the loop looks then, not at its next poll
        self._held = HeldSlots()  # the launched jobs and their slots
        self._dead_since: dict[str, float] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if hasattr(runners, "on_exit"):
            runners.on_exit = lambda job_id: self._wake.set()  # a runner that exits frees its slots now

    # ---- the API's calls ----------------------------------------------------------------------
    def submit(self, spec: JobSpec, *, sizes: dict | None = None, owner: str = BOOTSTRAP_ADMIN) -> dict:
        """Store ``owner``'s job QUEUED, in the queue at ``spec.priority``; raises :class:`NeverFits` when
        the cluster can never hold it."""
        res = spec.resources
        probe = QueuedJob(id=spec.name, submitted_at=0.0, priority=spec.priority,
                          num_nodes=res.num_nodes + res.spare_nodes, gpus_per_node=res.gpus_per_node)
        refusal = can_ever_fit(probe, self.total_slots())
        if refusal is not None:
            if res.spare_nodes:
                refusal += (f" (resources.num_nodes {res.num_nodes} + resources.spare_nodes {res.spare_nodes}: "
                            f"lower spare_nodes)")
            raise NeverFits(refusal.replace(f"job {spec.name} ", "this job ", 1))
        row = self.store.create_job(spec.model_dump(mode="json"), name=spec.name, priority=spec.priority, sizes=sizes,
                                    owner=owner)
        self._wake.set()
        return row

    def cancel(self, job_id: str) -> dict:
        """Cancel a job: a queued one at once, a running one through its runner back end (in the background)."""
        with self._lock:
            row = self.store.get_job(job_id)
            if row is None:
                raise UnknownJob(f"no job {job_id!r}")
            if row["state"] in TERMINAL_STATES:
                raise JobNotActive(f"job {job_id} is {row['state']} already; only a queued or running job can be "
                                   f"cancelled")
            self._cancelled.add(job_id)
            self._quota_noted.pop(job_id, None)
            if job_id not in self._held:
                try:
                    return self.store.update_job(
                        job_id, state=JobState.CANCELLED.value, message="cancelled while queued",
                        error={"code": "cancelled", "message": "cancelled while queued"})
                except InvalidTransition:
                    return self.store.get_job(job_id)
        threading.Thread(target=self._cancel_runner, args=(job_id,), daemon=True, name=f"cancel-{job_id}").start()
        return row

    def total_slots(self) -> dict[str, int]:
        return {n.node_id: n.gpus for n in self.cluster.nodes() if n.alive}

    def used_slots(self) -> dict[str, int]:
        with self._lock:
            return self._held.used()

    def queue_length(self) -> int:
        with self._lock:
            return sum(1 for r in self.store.jobs_in_states(JobState.QUEUED.value) if r["id"] not in self._held)

    # ---- the loop -----------------------------------------------------------------------------
    def start(self) -> None:
        """Recover the jobs of an earlier server, then run the loop in a daemon thread."""
        self.recover()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="raytron-scheduler")
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop; running jobs keep running (a restarted server re-attaches to them)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def recover(self) -> None:
        """Re-attach to the runners of jobs an earlier server launched; a new runner for vanished ones."""
        for row in self.store.jobs_in_states(JobState.QUEUED.value, *ACTIVE_STATES):
            admission = self.store.events(row["id"], kind="admission")
            if row["state"] == JobState.QUEUED.value and not admission:
                continue  # never launched: it waits in the queue as before
            nodes = tuple(admission[-1]["data"].get("nodes", ())) if admission else ()
            if self.runners.reattach(row):
                log.info("re-attached to job %s (%s)", row["id"], row["state"])
                with self._lock:
                    self._held.hold(row["id"], nodes, queued_job(row))
            elif row["state"] == JobState.QUEUED.value:
                # Admitted, but its runner never recorded a thing (the server died around the launch):
                # nothing ran, so it simply waits for admission again.
                log.info("job %s was admitted but never started; it is queued again", row["id"])
            else:
                with self._lock:
                    job = queued_job(row)
                    self._held.hold(row["id"], self._held.recovered_nodes(job, nodes, self.total_slots()), job)
                self._runner_gone(row["id"], "runner_vanished", "the job's runner was gone when the server restarted")

    def step(self) -> None:
        """One pass: supervise launched runners, then admit and launch what fits."""
        self._supervise()
        self._admit()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the pass: a wake during it makes the next pass start at once
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad pass (database busy...)
                log.exception("scheduler pass failed; retrying")
            look_at = self._look_at
            self._wake.wait(self.poll_s if look_at is None else min(self.poll_s, max(0.0, look_at - time.monotonic())))

    def _supervise(self) -> None:
        with self._lock:
            launched = list(self._held)
        self._look_at = None
        for job_id in launched:
            row = self.store.get_job(job_id)
            alive = self.runners.is_alive(job_id)
            if row is not None and row["state"] in TERMINAL_STATES and not alive:
                self._release(job_id)
                continue
            if alive:
                self._dead_since.pop(job_id, None)
                continue
            since = self._dead_since.setdefault(job_id, time.monotonic())
            grace = self.vanish_grace_s if job_id in self._cancelled else self.exit_grace_s
            if time.monotonic() - since < grace:
                self._look_at = min(self._look_at or math.inf, since + grace)
                continue  # its last events may still be landing
            if job_id in self._cancelled:
                self._finish(job_id, JobState.CANCELLED.value, "cancelled", "cancelled by request")
            elif row is not None and self._runner_gone(job_id, "runner_exited", "the job's runner exited without "
                                                       "recording a final state"):
                continue  # a new runner goes on with the job, on the slots it holds
            self._release(job_id)

    def _admit(self) -> None:
        with self._lock:
            queued = [queued_job(r) for r in self.store.jobs_in_states(JobState.QUEUED.value)
                      if r["id"] not in self._held]
            if not queued:
                return
            total = self.total_slots()
            free = free_slots(total, self.used_slots())
            quotas = {owner: self.quota_of(owner) for owner in {j.owner for j in queued if j.owner is not None}}
            plan = admit(free, queued, cluster_total=total, quotas=quotas, held=self._held.by_owner())
            for job, why, owner_held in plan.over_quota:
                if self._quota_noted.get(job.id) != why:
                    self._quota_noted[job.id] = why
                    data = {"reason": "gpu_quota", "quota": quotas[job.owner], "held": owner_held,
                            "needed": job.num_gpus}
                    self.store.append_event(job.id, JobEvent.now("waiting", JobState.QUEUED, why, data).to_dict())
            for job, refusal in plan.never_fit:
                self._finish(job.id, JobState.FAILED.value, "never_fits", refusal)
            for admission in plan.start:
                self._launch(admission.job, admission.nodes)

    def _launch(self, job: QueuedJob, nodes: tuple) -> None:
        nodes = tuple(str(n) for n in nodes)
        # Recorded before the runner starts: a server killed right after still knows the slots are held.
        self.store.append_event(job.id, {"time": time.time(), "kind": "admission", "state": JobState.QUEUED.value,
                                         "message": f"admitted on {', '.join(nodes)}", "data": {"nodes": list(nodes)}})
        self._held.hold(job.id, nodes, job)
        self._quota_noted.pop(job.id, None)
        row = self.store.get_job(job.id)
        try:
            handle = self.runners.launch(row)
            log.info("launched job %s (%s)", job.id, handle)
        except Exception as exc:  # noqa: BLE001 - a launch failure fails the job, not the server
            log.exception("launching job %s failed", job.id)
            self._finish(job.id, JobState.FAILED.value, "launch_failed", f"could not start the job's runner: {exc}")
            self._held.drop(job.id)

    def _runner_gone(self, job_id: str, code: str, why: str) -> bool:
        """The runner of a job that has not ended is gone: start a new one, which goes on from the
        job's record (True), or record FAILED when the job's restarts are spent (False); see
        :mod:`service.server.runner_restarts`."""
        event = new_runner_event(self.store, self.store.get_job(job_id), code, why)
        if isinstance(event, str):
            self._finish(job_id, JobState.FAILED.value, code, event)
            return False
        self.store.append_event(job_id, event)
        self._dead_since.pop(job_id, None)
        try:
            handle = self.runners.launch(self.store.get_job(job_id))
            log.info("job %s: %s; started a new runner (%s)", job_id, why, handle)
            return True
        except Exception as exc:  # noqa: BLE001 - a launch failure fails the job, not the server
            log.exception("starting a new runner for job %s failed", job_id)
            self._finish(job_id, JobState.FAILED.value, "launch_failed", f"could not start the job's runner: {exc}")
            return False

    def _cancel_runner(self, job_id: str) -> None:
        try:
            self.runners.cancel(job_id)
        finally:
            self._wake.set()

    def _release(self, job_id: str) -> None:
        with self._lock:
            self._held.drop(job_id)
            self._dead_since.pop(job_id, None)
            self._cancelled.discard(job_id)
        reap = getattr(self.runners, "reap", None)
        if reap is not None:
            reap(job_id)
        self._wake.set()  # its slots are free: the queue may move

    def _finish(self, job_id: str, state: str, code: str, message: str) -> None:
        try:
            self.store.update_job(job_id, state=state, message=message, error={"code": code, "message": message})
        except InvalidTransition:
            pass  # the runner recorded its own final state in the meantime
