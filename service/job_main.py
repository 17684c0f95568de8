"""One job's runner process: ``python -m service.job_main JOB_ID --data-dir DIR --database-url URL``.

Started by a launcher (:mod:`service.launchers`) once the queue admits the job. It loads the
job's spec from the store, runs it and appends every :class:`~service.controller.JobEvent` to
the store *before* going on (:class:`StoreRecorder`), so the store always holds the whole truth
and a restarted server simply reads it. Its stdout and stderr are the job's log
(``DATA_DIR/jobs/JOB_ID/driver.log``, see :mod:`service.logs`).

SIGTERM (the launcher's cancel) stops the job: it ends CANCELLED, with its ranks stopped.

:func:`run_training` is the one place that starts the ranks; it is meant to become
``start_job(job, launcher=..., on_event=recorder, ...)`` of the single orchestration path.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Callable

from service.controller import JobCancelled, JobError, JobEvent, JobState
from service.spec import parse_spec, to_job_config
from service.store import TERMINAL_STATES, JobStore
from workers.config import JobConfig
from workers.grid import ParallelGrid

log = logging.getLogger("raytron.job")


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
        if d["kind"] == "iteration":
            m = d["data"]
            log.info("iteration %s loss %.6f tokens/s %.0f", m.get("iteration"), m.get("loss", float("nan")),
                     m.get("tokens_per_s") or 0.0)
        else:
            log.info("event %d %s %s %s", seq, d["kind"], d["state"], d["message"])


def _rank_entry(rank: int, world_size: int, job: JobConfig, report: Callable[[dict], None]) -> dict:
    """What each local rank process runs: like ``workers.rank_main.train_rank``, but every rank
    reports where it runs, so the placement is what the ranks say, not what the plan meant."""
    from workers.rank_main import rank_info
    from workers.spawn import rank_device
    from workers.train import Trainer

    trainer = Trainer(job, rank, world_size, device=rank_device(rank))
    info = rank_info(trainer)
    report({"event": "ready", "rank": info})
    for _ in range(job.training.train_iters):
        metrics = trainer.train_step()
        if rank == 0:  # the loss is global: every rank has the same
            report({"event": "iteration", **metrics})
    return info


def run_training(job_id: str, job: JobConfig, grid: ParallelGrid, on_event: Callable[[JobEvent], None]) -> str:
    """Run the job's ranks to the end, handing every event to ``on_event``; returns the final state.

    TO BE REPLACED by the single orchestration path: ``start_job(job, launcher=..., on_event=on_event)``
    and its ``JobController.run()`` (cancel through ``controller.cancel``). Until then this is the
    ``--launcher processes`` path of ``raytron run`` (``workers.spawn.run_ranks``), emitting the
    controller's event vocabulary: STARTING, placement, RUNNING, iteration..., SUCCEEDED | FAILED
    (after a "failure" event) | CANCELLED.
    """
    from workers.spawn import run_ranks

    state = JobState.STARTING
    on_event(JobEvent.now("state", state, f"starting {grid.world_size} local rank process(es)",
                          {"from": JobState.QUEUED.value}))
    ready: dict[int, dict] = {}

    def on_rank_event(rank: int, payload: dict) -> None:
        nonlocal state
        if payload.get("event") == "ready":
            ready[rank] = payload["rank"]
            if len(ready) == grid.world_size:
                placement = [ready[r] for r in sorted(ready)]
                on_event(JobEvent.now("placement", state, f"{len(placement)} ranks placed", {"placement": placement}))
                on_event(JobEvent.now("state", JobState.RUNNING, "training", {"from": state.value}))
                state = JobState.RUNNING
        elif payload.get("event") == "iteration":
            on_event(JobEvent.now("iteration", state, "", {k: v for k, v in payload.items() if k != "event"}))

    try:
        run_ranks(_rank_entry, grid.world_size, args=(job,), on_event=on_rank_event, timeout_s=7 * 24 * 3600,
                  collective_timeout_s=300)
    except (JobCancelled, KeyboardInterrupt) as exc:
        on_event(JobEvent.now("state", JobState.CANCELLED, str(exc) or "cancelled", {"from": state.value}))
        return JobState.CANCELLED.value
    except Exception as exc:  # noqa: BLE001 - every failure must end in a recorded state
        error = exc if isinstance(exc, JobError) else JobError(f"{type(exc).__name__}: {exc}")
        data = {**error.to_dict(), **({"rank": exc.rank} if hasattr(exc, "rank") else {})}
        on_event(JobEvent.now("failure", state, str(error).splitlines()[0], data))
        on_event(JobEvent.now("state", JobState.FAILED, str(error).splitlines()[0], {"from": state.value}))
        return JobState.FAILED.value
    on_event(JobEvent.now("state", JobState.SUCCEEDED, f"{job.training.train_iters} iterations",
                          {"from": state.value}))
    return JobState.SUCCEEDED.value


def _on_sigterm(signum, frame) -> None:
    # Raised in the main thread wherever it is (the rank loop polls every 0.2 s): the ranks are
    # torn down by run_ranks' cleanup and CANCELLED is recorded.
    raise JobCancelled("cancelled by request")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.job_main", description=__doc__.splitlines()[0])
    parser.add_argument("job_id")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--database-url", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, _on_sigterm)
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
            spec = {k: v for k, v in row["spec"].items() if k != "priority"}
            job = to_job_config(parse_spec(spec))
            grid = ParallelGrid.from_config(job.parallel, job.world_size)
        except ValueError as e:  # the server validated it; a spec written by another version may not be
            recorder(JobEvent.now("state", JobState.FAILED, f"invalid spec: {e}",
                                  {"error": {"code": "invalid_spec", "message": str(e)}}))
            return 1
        log.info("job %s: %d rank(s), sizes %s", args.job_id, grid.world_size, grid.sizes())
        final = run_training(args.job_id, job, grid, recorder)
        log.info("job %s %s", args.job_id, final)
        return 0 if final == JobState.SUCCEEDED.value else 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
