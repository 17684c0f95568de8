"""One job's runner process: ``python -m service.server.job_main JOB_ID --data-dir DIR --database-url URL
[--launcher processes|ray] [--fault RANK@ITER:KIND]...``.

Started by a runner back end (:mod:`service.server.runners`) once the queue admits the job. It loads the
job's spec from the store, runs it and appends every :class:`~service.control.controller.JobEvent` to
the store *before* going on (:class:`StoreRecorder`), so the store always holds the whole truth
and a restarted server simply reads it. Its stdout and stderr are the job's log
(``DATA_DIR/jobs/JOB_ID/driver.log``, see :mod:`service.server.logs`).

A runner started for a job that an earlier runner of it had already started (that runner is
gone: killed, or lost with its node) goes on from the job's record: the store's events are
replayed into the controller (``start_job(history=...)``), which counts the lost attempt as a
restart and resumes from the latest checkpoint whose iterations the record holds, so the curve
stays whole and no event is written twice.

SIGTERM (the back end's cancel) stops the job: it ends CANCELLED, with its ranks stopped.

A runner on Ray whose own connection is cut (its node's raylet dead, or the GCS gone with the
head node) can neither start ranks nor tell that it cannot. A watch
(:class:`~service.ranks.ray_watch.ConnectionWatch`) notices within seconds; the runner then
records a ``failure`` event with code ``ray_connection_lost`` and the reason, and exits with
:data:`EXIT_RAY_LOST` without a final state, so that the server starts a new runner that goes on
from the record (or fails the job once its restarts are spent).

:func:`run_training` starts the ranks through the single orchestration path
(:func:`service.control.jobs.start_job`): the same controller, failure policy, restarts and events as
``raytron run``, with the ranks as local processes or (``--launcher ray``, as the Ray Jobs back
end starts it) as actors on the cluster.

``--fault`` (repeatable) carries the server's failure drills (``raytron serve --fault``): they
apply to every job the server runs, so a drill whose rank is outside this job's ranks is left
out (logged), and a small job runs undisturbed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Callable

from service.control.controller import JobEvent, JobState
from service.control.jobs import start_job
from service.control.tracking import Tracking
from service.ranks.launcher import LAUNCHERS, open_launcher
from service.spec.spec import parse_spec, to_job_config
from service.server.store import TERMINAL_STATES, JobStore
from workers.config import JobConfig
from workers.rank.faults import Fault
from workers.grid import ParallelGrid

log = logging.getLogger("raytron.job")

EXIT_RAY_LOST = 3
"""The runner's exit status when its Ray connection was lost (the job is left to a new runner)."""


class StoreRecorder:
    """``on_event`` for a job controller: appends each event to the store, in order, synchronously.

    The controller's first event (QUEUED, emitted when it is built) is not stored: the store
    recorded the submission already, and the job is QUEUED there until the runner's STARTING.
    """

    def __init__(self, store: JobStore, job_id: str):
        self.store, self.job_id = store, job_id

    def __call__(self, event: JobEvent) -> None:
        d = event.to_dict()
        if d["kind"] == "state" and d["state"] == JobState.QUEUED.value:
            return
        seq = self.store.append_event(self.job_id, d)
        if d["kind"] == "resize":  # the job's sizes column shows the size it runs at now
            self.store.update_job(self.job_id, sizes=d["data"]["new"]["sizes"])
        if d["kind"] == "iteration":
            m = d["data"]
            log.info("iteration %s loss %.6f tokens/s %.0f", m.get("iteration"), m.get("loss", float("nan")),
                     m.get("tokens_per_s") or 0.0)
        else:
            log.info("event %d %s %s %s", seq, d["kind"], d["state"], d["message"])


def run_training(job_id: str, job: JobConfig, on_event: Callable[[JobEvent], None], *, launcher: str = "processes",
                 cancel_requested: threading.Event | None = None, checkpoint_root: str | None = None,
                 faults: list[Fault] | tuple = (), history: list[JobEvent] | None = None,
                 on_ray_lost: Callable[[str], None] | None = None) -> str:
    """Run the job through the single orchestration path (:func:`service.control.jobs.start_job`), handing
    every event to ``on_event``; returns the final state. Setting ``cancel_requested`` (from any
    thread or a signal handler) cancels the job: it ends CANCELLED with every rank stopped.
    ``launcher``: where the ranks run: local processes, or actors on the Ray cluster this runner is
    a Ray Job of (``RAY_ADDRESS`` is set for a Ray Job's entry point).
    ``faults``: failure drills, each inside the job's ranks (see :func:`drills_for`).
    ``history``: the job's recorded events, when an earlier runner of it started it (see :func:`history_of`).
    ``on_ray_lost``: with ``launcher="ray"``, called with the reason when this process's Ray
    connection is gone (see :func:`ray_lost_handler`)."""
    cancel_requested = cancel_requested or threading.Event()
    with open_launcher(launcher, shape=(job.num_nodes, job.gpus_per_node), note=lambda line: log.info("%s", line),
                       on_ray_lost=on_ray_lost) as ranks:
        if cancel_requested.is_set():  # a cancel that arrived while the cluster connection came up
            on_event(JobEvent.now("state", JobState.CANCELLED, "cancelled by request",
                                  {"from": JobState.QUEUED.value}))
            return JobState.CANCELLED.value
        controller = start_job(job, launcher=ranks, on_event=on_event, job_id=job_id,
                               checkpoint_root=checkpoint_root, faults=faults, history=history)
        while controller.wait(timeout=0.2) is None:
            if cancel_requested.is_set():
                controller.cancel("cancelled by request")
                cancel_requested.clear()
        return controller.state.value


def ray_lost_handler(store: JobStore, job_id: str, exit: Callable[[int], None] = os._exit) -> Callable[[str], None]:
    """What the runner does when its Ray connection is gone: record a ``failure`` event (code
    ``ray_connection_lost``) in the job's current state, say so in its log, and exit at once with
    :data:`EXIT_RAY_LOST`, leaving no final state: the server starts a new runner. ``os._exit``,
    not ``sys.exit``: the main thread may be blocked in a Ray call that will never return, and the
    ranks' actors die with this driver (Ray fate-shares actors with their owner)."""

    def handle(reason: str) -> None:
        message = f"the job's runner lost its Ray connection: {reason}"
        try:
            row = store.get_job(job_id)
            state = row["state"] if row is not None else JobState.RUNNING.value
            store.append_event(job_id, JobEvent.now("failure", JobState(state), message,
                                                    {"code": "ray_connection_lost", "message": message}).to_dict())
        except Exception as e:  # noqa: BLE001 - exit anyway: the server sees the runner gone
            log.error("could not record the lost Ray connection: %s", e)
        log.error("%s; exiting (status %d) so that a new runner goes on from the job's record", message,
                  EXIT_RAY_LOST)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        exit(EXIT_RAY_LOST)

    return handle


def history_of(store: JobStore, job_id: str, state: str) -> list[JobEvent] | None:
    """The job's recorded events when an earlier runner of it got past QUEUED (that runner is gone),
    for its controller to replay; None for a job that starts now for the first time."""
    if state == JobState.QUEUED.value:
        return None
    return [JobEvent.from_dict(e) for e in store.events(job_id)]


def drills_for(faults: list[Fault], world_size: int) -> tuple[list[Fault], list[Fault]]:
    """The server-wide drills that apply to a job of ``world_size`` ranks, and those left out
    (their rank is outside the job: the controller would refuse them)."""
    return [f for f in faults if f.within(world_size)], [f for f in faults if not f.within(world_size)]


def build_parser() -> argparse.ArgumentParser:
    """The runner's command line (:func:`service.server.runners.runner_command` writes it)."""
    parser = argparse.ArgumentParser(prog="python -m service.server.job_main", description=__doc__.splitlines()[0])
    parser.add_argument("job_id")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--launcher", choices=LAUNCHERS, default="processes",
                        help="where the ranks run: local processes, or actors on the Ray cluster")
    parser.add_argument("--fault", type=Fault.parse, action="append", default=[], metavar="RANK@ITER:KIND",
                        help="failure drill (repeatable); those outside the job's ranks are left out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    cancel_requested = threading.Event()
    # The launcher's cancel is SIGTERM: the handler only sets a flag that the waiting loop turns
    # into controller.cancel() (raising here could leave half-started ranks behind).
    signal.signal(signal.SIGTERM, lambda signum, frame: cancel_requested.set())
    store = JobStore(args.database_url)
    try:
        row = store.get_job(args.job_id)
        if row is None:
            log.error("no job %s in %s", args.job_id, store.url)
            return 2
        if row["state"] in TERMINAL_STATES:
            log.error("job %s is %s already; nothing to run", args.job_id, row["state"])
            return 0
        recorder = StoreRecorder(store, args.job_id)
        try:
            spec = parse_spec(row["spec"])
            job = to_job_config(spec)
            grid = ParallelGrid.from_config(job.parallel, job.world_size)
        except ValueError as e:  # the server validated it; a spec written by another version may not be
            recorder(JobEvent.now("state", JobState.FAILED, f"invalid spec: {e}",
                                  {"error": {"code": "invalid_spec", "message": str(e)}}))
            return 1
        log.info("job %s: %d rank(s), sizes %s", args.job_id, grid.world_size, grid.sizes())
        faults, outside = drills_for(args.fault, grid.world_size)
        if faults:
            log.info("failure drills: %s", " ".join(map(str, faults)))
        if outside:
            log.info("failure drills left out (rank outside the job's %d ranks): %s", grid.world_size,
                     " ".join(map(str, outside)))
        history = history_of(store, args.job_id, row["state"])
        if history:
            log.info("job %s was %s under an earlier runner: going on from its %d recorded events",
                     args.job_id, row["state"], len(history))
        # MLflow (service/control/tracking.py): the recorded events first, then the new ones
        on_event = Tracking.of(spec.model_dump(mode="json"), args.job_id, recorder, row["state"], history)
        final = run_training(args.job_id, job, on_event, launcher=args.launcher, cancel_requested=cancel_requested,
                             checkpoint_root=os.path.join(args.data_dir, "checkpoints"), faults=faults,
                             history=history, on_ray_lost=ray_lost_handler(store, args.job_id))
        if isinstance(on_event, Tracking):
            on_event.close(final)
        log.info("job %s %s", args.job_id, final)
        return 0 if final == JobState.SUCCEEDED.value else 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
