"""The job controller's record: the events its steps become, what counts as a restart, and the state a recorded history ends with.

:class:`~service.control.controller.JobController` hands every event to ``on_event`` before it
takes effect; this module writes those events (a QUEUED job's first line, an attempt's STARTING,
a resize, the iterations of one call with their checkpoints and copies) and reads them back
(:func:`count_restarts`, :func:`replay`), so a controller rebuilt from a job's events carries on
where they end. Pure: no ranks, no threads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from service.control.errors import JobError, NonFiniteMetric
from service.control.events import JobEvent, JobState, retention_message
from service.spec.megatron_load import source_optimizer_note
from service.spec.placement import check_tp_in_node
from workers.config import JobConfig
from workers.grid import ParallelGrid

CHECKED_METRICS = ("loss", "grad_norm")  # a non-finite value of either fails the job at that iteration


def is_restart(event: JobEvent) -> bool:
    """Whether ``event`` counts as a restart: a RESTARTING transition that recovers the job (after
    a failure the policy restarts, or a controller rebuilt after its ranks were lost), not one that
    only resizes it (``data["resize"]``: a shrink while an attempt waited for nodes, a grow back at
    a checkpoint) or moves it off nodes being drained (``data["preempted"]``). Every ``restarts`` (the controller's, so ``raytron run --json``'s and the failure
    policy's; the REST API's; /metrics') is the number of these events; a job has one attempt per
    STARTING, so after a resize it has more attempts than restarts + 1."""
    return (event.kind == "state" and event.state is JobState.RESTARTING and not event.data.get("resize")
            and not event.data.get("preempted"))  # a move off drained nodes: service.control.preemption


def count_restarts(events: Iterable[JobEvent]) -> int:
    """The restarts in a job's events (:func:`is_restart`)."""
    return sum(1 for e in events if is_restart(e))


def queued_message(job: JobConfig, grid: ParallelGrid, job_id: str) -> str:
    """The message of a new job's QUEUED event: its ranks, nodes and checkpoint saves."""
    saves = f"; checkpoints every {job.checkpoint.save_interval} iterations in {job.checkpoint.dir}" \
        if job.checkpoint.save_interval and job.checkpoint.dir else ""
    return (f"job {job_id}: {grid.world_size} ranks on {job.num_nodes} node(s) x {job.gpus_per_node} "
            f"GPU(s){saves}")


def resize_event(state: JobState, old: JobConfig, old_grid: ParallelGrid, new: JobConfig,
                 new_grid: ParallelGrid) -> JobEvent:
    """The ``resize`` event of an attempt that runs on another world size than the one before."""
    before, after = old_grid.sizes(), new_grid.sizes()
    changes = ", ".join(f"{k} {before[k]} -> {after[k]}" for k in ("tp", "pp", "cp", "ep", "dp")
                        if before[k] != after[k])  # more than dp: a re-pick (service.control.relayout)
    return JobEvent.now("resize", state, f"{changes} ({old.num_nodes} -> {new.num_nodes} node(s)); global batch "
                        f"{new.training.global_batch_size} kept",
                        {"old": {"num_nodes": old.num_nodes, "sizes": before},
                         "new": {"num_nodes": new.num_nodes, "sizes": after}})


def starting_transition(events: list[JobEvent], source: str | None, job: JobConfig,
                        grid: ParallelGrid) -> tuple[str, dict]:
    """The message and data of an attempt's STARTING transition, after the job's ``events`` so far:
    the attempt's number, the checkpoint it resumes from (``source``) and its size."""
    number = 1 + sum(1 for e in events if e.kind == "state" and e.state is JobState.STARTING)
    attempt = f" (attempt {number})" if number > 1 else ""  # numbered as the job store numbers attempts
    # hf:DIR holds weights only, megatron:DIR maybe Adam's state too: the attempt says which
    fresh, note = source_optimizer_note(source)
    return ("placing ranks" + attempt + (f" from {source}" if source else "") + (f" ({note})" if note else ""),
            {"from_checkpoint": source, "num_nodes": job.num_nodes, "sizes": grid.sizes(), "fresh_optimizer": fresh})


def placement_event(state: JobState, grid: ParallelGrid, placement: list[dict],
                    extra: Callable[[], dict]) -> JobEvent:
    """The ``placement`` event of an attempt's ranks, with what ``extra()`` adds (the launcher's, e.g.
    hot spares). Raises :class:`JobError` when a tensor-parallel group spans several nodes."""
    split = check_tp_in_node(grid, {p["rank"]: p["node_id"] for p in placement})
    if split:  # the plan keeps them together; this guards the plan -> node mapping end to end
        raise JobError(f"tensor-parallel groups {split} span several nodes")
    return JobEvent.now("placement", state, f"{len(placement)} ranks placed", {"placement": placement, **extra()})


def check_finite(iteration: int, metrics: dict) -> None:
    """Raise :class:`NonFiniteMetric` when a :data:`CHECKED_METRICS` value of ``metrics`` is not finite."""
    for name in CHECKED_METRICS:
        value = metrics.get(name)
        if value is not None and not math.isfinite(value):
            raise NonFiniteMetric(iteration, "lm loss" if name == "loss" else name.replace("_", " "), value)


def iteration_events(state: JobState, iteration: int, metrics: dict) -> list[JobEvent]:
    """The events of one finished iteration from rank 0's ``metrics``: the iteration, then the
    checkpoint committed at it (its retention) and each Hugging Face / Megatron-Core copy written.
    Takes those two out of ``metrics``; raises :class:`NonFiniteMetric` (no event) on a non-finite loss."""
    retention = metrics.pop("checkpoint_retention", None)  # rank 0's, after a commit
    hf_copies = metrics.pop("checkpoint_hf", [])  # rank 0's, once written
    check_finite(iteration, metrics)
    out = [JobEvent.now("iteration", state, "", metrics)]
    if retention is not None:
        out.append(checkpoint_event(state, retention))
    for copy in hf_copies:
        kind = copy.get("format", "hf")
        what = "Megatron-Core torch_dist copy" if kind == "megatron" else "Hugging Face copy"
        out.append(JobEvent.now("checkpoint", state, f"{what} of iteration {copy['iteration']} written to "
                                f"{copy['path']}", {kind: copy}))
    return out


def checkpoint_event(state: JobState, retention: dict) -> JobEvent:
    """The ``checkpoint`` event of a committed checkpoint and what its retention kept."""
    return JobEvent.now("checkpoint", state, retention_message(retention), retention)


@dataclass
class Replay:
    """What a job's recorded events end with (:func:`replay`)."""

    state: JobState = JobState.QUEUED
    metrics: list[dict] = field(default_factory=list)
    placement: list[dict] = field(default_factory=list)
    error: JobError | None = None
    spent: int = 0
    """Failure drills at or before this iteration have had their one chance."""


def replay(history: list[JobEvent]) -> Replay:
    """The state, metrics (the whole curve: an iteration run again replaces the later ones),
    placement and error that ``history`` ends with. A drill is spent when a recorded failure's
    iteration or the last recorded one reached it (``spent``, with ``len(metrics)``)."""
    out = Replay()
    iteration = 0
    for event in history:
        if event.kind == "state":
            out.state = event.state
        elif event.kind == "iteration":
            it = event.data.get("iteration")
            if isinstance(it, int) and 1 <= it <= len(out.metrics):
                del out.metrics[it - 1:]  # a later attempt ran it again from a checkpoint
            out.metrics.append(event.data)
            iteration = len(out.metrics)
        elif event.kind == "placement":
            out.placement = event.data.get("placement", [])
        elif event.kind == "failure":
            out.spent = max(out.spent, iteration + 1)
            if out.state.is_terminal:
                out.error = JobError(event.message)
    out.spent = max(out.spent, iteration)
    if out.state.is_terminal and out.state is not JobState.SUCCEEDED and out.error is None:
        out.error = JobError(history[-1].message)
    return out
