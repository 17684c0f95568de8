"""The one orchestration path: validate a job, then drive it with a :class:`JobController`.

Whatever starts the ranks (local processes, Ray actors), :func:`start_job` builds the same
controller over the launcher's rank groups: same states, events, typed errors, cancel and
failure policy. Nothing here prints; callers subscribe to the events (``on_event``).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import replace
from typing import Callable

from service.control.controller import JobController
from service.control.rank_group import Launcher
from service.control.events import JobEvent
from service.spec.placement import plan_placement
from service.control.policy import FailurePolicy
from service.spec.spec import load_spec, to_job_config
from workers.config import JobConfig
from workers.rank.faults import Fault
from workers.grid import ParallelGrid


def prepare(spec_path: str) -> tuple[JobConfig, ParallelGrid]:
    """Everything that can be refused before a process starts. Raises ValueError naming the file."""
    from workers.data.dataset import check_corpus

    job = to_job_config(load_spec(spec_path))
    try:
        grid = ParallelGrid.from_config(job.parallel, job.world_size)
        plan_placement(grid, job.gpus_per_node, job.num_nodes)
        check_corpus(job.training.data, job.model.vocab_size, job.model.seq_length)
    except ValueError as e:
        raise ValueError(f"{spec_path}: {e}") from None
    return job, grid


def new_job_id(job: JobConfig) -> str:
    return f"{job.name}-{uuid.uuid4().hex[:8]}"


def start_job(job: JobConfig, *, launcher: Launcher, on_event: Callable[[JobEvent], None] | None = None,
              job_id: str | None = None, faults: list[Fault] | tuple = (),
              failure_policy: FailurePolicy | None = None, history: list[JobEvent] | None = None,
              background: bool = True, checkpoint_root: str | None = None,
              layout: dict | None = None) -> JobController:
    """Build the job's controller over ``launcher`` and start it.

    Args:
        job: a validated job (:func:`prepare`).
        launcher: builds each attempt's rank group.
        on_event: receives every :class:`JobEvent` before it takes effect.
        job_id: default a fresh one.
        faults: failure drills (``--fault``).
        failure_policy: default ``fault_tolerance.max_restarts``.
        history: the job's recorded events, to rebuild its controller.
        background: run in a thread (then ``controller.wait()``); False: only build it
            (then ``controller.run()``).
        checkpoint_root: where a job with ``checkpoint.save_interval`` (or a launcher whose
            preemption notices save, ``saves_on_notice``) and no ``checkpoint.dir`` saves (in ``ROOT/JOB_ID``);
            default ``./raytron-checkpoints``.
        layout: an auto layout's record (:func:`service.control.trials.layout_record`): a
            ``layout`` event after QUEUED.

    Returns:
        The controller; ``cancel()`` stops the job from any thread.
    """
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    job_id = job_id or new_job_id(job)
    drains = getattr(launcher, "drain_notices", None)
    if (job.checkpoint.save_interval or getattr(launcher, "saves_on_notice", False)) and not job.checkpoint.dir:
        root = checkpoint_root or os.path.join(os.getcwd(), "raytron-checkpoints")
        job = replace(job, checkpoint=replace(job.checkpoint, dir=os.path.join(root, job_id)))
    nodes = getattr(launcher, "nodes_available", None)
    release = getattr(launcher, "release", None)
    controller = JobController(
        job, grid, job_id=job_id, on_event=on_event, failure_policy=failure_policy, faults=faults,
        history=history, iterations_per_call=launcher.config.iterations_per_call,
        call_target_s=launcher.config.call_target_s,
        nodes_available=None if nodes is None else (lambda: nodes(job.gpus_per_node)),
        make_group=lambda attempt, attempt_job, attempt_grid: launcher.make_group(
            attempt_job, attempt_grid, attempt, job_id=job_id),
        release=None if release is None else (lambda: release(job_id)), layout=layout,
        drain_notices=drains)  # preemption notices (service.control.preemption)
    return controller.start() if background else controller
