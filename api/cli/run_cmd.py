"""``raytron run``: validate, start the job through :func:`service.control.jobs.start_job`, render its
events, print the result, and turn SIGINT/SIGTERM into a cancel.

Exit status: 0 SUCCEEDED, 1 FAILED, 2 invalid input (nothing started), 130 / 143 cancelled by
SIGINT / SIGTERM (the job ends CANCELLED with every rank stopped, also during start-up).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from api.cli.errors import UsageError
from api.cli.render import RunView, final_line, result_json
from api.cli.tables import print_placement_plan
from service.control.errors import JobError
from service.control.jobs import new_job_id, prepare, start_job
from service.spec.placement import plan_placement
from service.control.result import result_object
from service.control.tracking import Tracking
from service.control.trials import layout_record
from service.spec.spec import read_spec_file
from service.ranks.launcher import open_launcher
from workers.rank.faults import Fault, check_ranks

_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class _Signals:
    """SIGINT and SIGTERM cancel the job. The handler never raises (an exception in the middle
    of a cluster's start-up would leave half-started processes behind): it asks the controller
    to cancel, or, before there is one, records the signal for the next checkpoint of
    :func:`cmd_run`, which then stops before starting anything more."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self.controller = None
        self._saved = {}

    def install(self) -> None:
        for sig in _EXIT:
            self._saved.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)  # again after ray.init, which installs its own

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            return  # one cancel is enough; it is under way
        self.received = signal.Signals(signum)
        if self.controller is not None:
            self.controller.cancel(f"cancelled by {self.received.name}")


def cmd_run(args) -> int:
    t0 = time.time()
    signals = _Signals()
    signals.install()
    try:
        from api.cli.plan_auto import trial_args_problem

        if problem := trial_args_problem(args, auto=True, trial_launcher=False):
            raise ValueError(problem)
        job, grid = prepare(args.spec)
        written = read_spec_file(args.spec)  # as written: its auto fields and trackers
        found = auto_choice(args.spec, written, getattr(args, "trial", None))
        faults = list(args.fault or [])
        check_ranks(faults, grid.world_size)
    except ValueError as e:
        signals.restore()
        raise UsageError(str(e)) from None
    if args.launcher == "processes":
        from workers.rank.main import torchrun_env

        env = torchrun_env()
        if env is not None:
            signals.restore()  # torchrun signals its processes itself
            return _torchrun(args, job, grid, env, faults)
    job_id = new_job_id(job)
    view = RunView(job.training.train_iters, job.name, quiet=args.json)
    if not args.json:
        print_placement_plan(grid, plan_placement(grid, job.gpus_per_node, job.num_nodes))
    result = None
    try:
        if signals.received is None:  # a signal during validation: start nothing
            with open_launcher(args.launcher, shape=(job.num_nodes, job.gpus_per_node), simulate=args.simulate,
                               note=lambda line: print(f"raytron: {line}", file=sys.stderr),
                               on_ray_lost=_ray_lost) as launcher:
                signals.install()  # again: starting Ray may have installed its own handlers
                if found is not None and args.trial and signals.received is None:
                    found, job, grid = _trials(args, found, launcher)
                if signals.received is None:
                    on_event = Tracking.of(written, job_id, view)  # service/control/tracking.py
                    controller = start_job(job, launcher=launcher, on_event=on_event, job_id=job_id, faults=faults,
                                           layout=None if found is None else layout_record(found))
                    signals.controller = controller
                    if signals.received is not None:  # arrived between the two lines above
                        controller.cancel(f"cancelled by {signals.received.name}")
                    while (result := controller.wait(0.2)) is None:
                        pass
                    if isinstance(on_event, Tracking):
                        on_event.close(result["state"])
    except JobError as e:  # the cluster could not be reached or started: one line, no job ran
        print(f"raytron run: error: {e}", file=sys.stderr)
        if args.json:
            print(result_json(result_object(job_id, "FAILED", grid, [], [], error=str(e))), flush=True)
        return 1
    finally:
        view.close()
        signals.restore()
    if signals.received is not None and (result is None or result["state"] == "CANCELLED"):
        if result is None:  # the signal came before the job started
            result = result_object(job_id, "CANCELLED", grid, [], [], error=f"cancelled by {signals.received.name}")
        _print_result(args, result, t0, note=f"cancelled by {signals.received.name}")
        return _EXIT[signals.received]
    _print_result(args, result, t0)
    return 0 if result["state"] == "SUCCEEDED" else 1


def auto_choice(spec_path: str, data: dict, trial: int | None) -> dict | None:
    """The layout search of a spec (``data``, as read from ``spec_path``) with ``auto`` fields (None
    without): what its ``layout`` event records. ``--trial K`` on a concrete spec is refused (there
    is nothing to choose)."""
    from service.spec.auto import auto_fields
    from service.spec.spec import search_layouts

    if not auto_fields(data):
        if trial:
            raise ValueError(f"--trial {trial}: {spec_path} fixes its layout; trials choose among the layouts of a "
                             f"spec with parallel: auto (or auto fields)")
        return None
    return search_layouts(data)


def _trials(args, found: dict, launcher):
    """Trials of the top ``--trial`` layouts (:mod:`service.control.trials`); the winner's job and grid."""
    from api.cli.plan_auto import print_trials
    from service.control.trials import TRIAL_ITERATIONS, run_trials, winner_job

    found = run_trials(found, args.trial, launcher, iterations=args.trial_iters or TRIAL_ITERATIONS,
                       note=lambda line: print(f"raytron: {line}", file=sys.stderr))
    if not args.json:
        print_trials(found)
    job, grid = winner_job(found)
    return found, job, grid


def _ray_lost(reason: str) -> None:
    """This process lost its Ray cluster (its raylet or the GCS is gone): one line, then exit 1 at
    once; the main thread may be blocked in a Ray call that will never return."""
    print(f"\nraytron run: error: lost the Ray cluster: {reason}", file=sys.stderr, flush=True)
    os._exit(1)


def _print_result(args, result: dict, t0: float, note: str = "") -> None:
    if args.json:
        print(result_json(result), flush=True)
    else:
        print(final_line(result, time.time() - t0, note), flush=True)
        if result.get("error") and not note:
            print(f"error: {result['error']}", file=sys.stderr)


def _torchrun(args, job, grid, env, faults: list[Fault]) -> int:
    from service.ranks.torchrun import run_torchrun_rank

    t0 = time.time()
    try:
        result = run_torchrun_rank(job, grid, env, job_id=new_job_id(job), faults=tuple(faults))
    except JobError as e:
        print(f"raytron run: {e}", file=sys.stderr)
        return 1
    if result is not None:
        _print_result(args, result, t0)
    return 0
