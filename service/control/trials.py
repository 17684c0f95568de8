"""Trials of the cost model's best layouts: ``raytron plan --auto --trial K`` and ``raytron run --trial K``.

Each of the top ``K`` candidates of :func:`service.spec.spec.search_layouts` runs ``iterations``
iterations on a launcher (local processes, or Ray: the real cluster or ``--simulate``), one
candidate after the other, through the same rank groups a job uses. Measured per candidate:

* ``measured_step_s``: the median over the iterations after the first (a warm-up: process
  groups, allocator, first-touch of the weights) of the slowest rank's ``step_time_s``;
* ``measured_peak_bytes``: the largest rank's ``peak_mem_mb`` after the last iteration: on CUDA
  the allocator's peak, on CPU the process's peak resident set (``ru_maxrss``, the kernel's
  ``VmHWM``), which includes the ~0.3 GB every rank holds before the model is built (the torch
  import), so on CPU it is above the cost model's bytes, which count only the training state.

The candidates are then ranked again by measured step time (:func:`rerank`); the winner is the
first. A trial that fails (a rank error, out of memory) keeps its error and ranks last. Trials
train on the spec's own data for a few iterations only: no checkpoint is saved or loaded. The
loss curve does not depend on the layout (the layout-invariance suites), so the winner is chosen
for speed alone.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable

from service.control.errors import JobError
from service.spec.spec import parse_spec, to_job_config
from workers.config import CheckpointConfig
from workers.grid import ParallelGrid

TRIAL_ITERATIONS = 3
"""Iterations per trial: the first is a warm-up, the others are measured."""
MB = 2**20


def trial_job(data: dict, iterations: int):
    """The job one trial runs: the candidate's concrete spec, ``iterations`` long, no checkpoints."""
    job = to_job_config(parse_spec(data))
    training = replace(job.training, train_iters=iterations)
    return replace(job, name=f"{job.name}-trial", training=training, checkpoint=CheckpointConfig(),
                   max_restarts=0, min_nodes=None)


def measure(per_rank: list[list[dict]]) -> dict:
    """Step time and peak bytes of one trial from every rank's metrics (module docstring)."""
    steps = [max(rank[i]["step_time_s"] for rank in per_rank) for i in range(len(per_rank[0]))]
    timed = steps[1:] or steps
    return {"measured_step_s": statistics.median(timed),
            "measured_peak_bytes": max(rank[-1]["peak_mem_mb"] for rank in per_rank) * MB,
            "measured_steps_s": steps, "losses": [m["loss"] for m in per_rank[0]]}


def run_trial(launcher, data: dict, iterations: int, job_id: str) -> dict:
    """One candidate's trial on ``launcher``; its measurements, or ``{"trial_error": ...}``."""
    job = trial_job(data, iterations)
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    group = launcher.make_group(job, grid, 0, job_id=job_id)
    try:
        group.start([])
        per_rank = group.run(iterations)
        return measure(per_rank)
    except JobError as e:
        return {"trial_error": str(e)}
    finally:
        group.shutdown()


def rerank(found: dict, measured: list[dict]) -> dict:
    """``found`` (a search's answer) with its first ``len(measured)`` candidates given their
    measurements and ordered by measured step time (failed trials last, then the untried ones in
    the model's order). Each candidate keeps ``predicted_rank``; ``chosen`` is 0, the winner."""
    tried = []
    for i, (cand, m) in enumerate(zip(found["candidates"], measured)):
        tried.append({**cand, **m, "predicted_rank": i})
    rest = [{**c, "predicted_rank": len(measured) + i} for i, c in enumerate(found["candidates"][len(measured):])]
    tried.sort(key=lambda c: (c.get("measured_step_s") is None, c.get("measured_step_s") or 0.0,
                              c["predicted_rank"]))
    if tried and tried[0].get("measured_step_s") is None:
        raise JobError("every trial failed: " + "; ".join(c["trial_error"] for c in tried))
    return {**found, "candidates": tried + rest, "chosen": 0, "trials": len(measured)}


def run_trials(found: dict, k: int, launcher, *, iterations: int = TRIAL_ITERATIONS, job_id: str = "trial",
               note: Callable[[str], None] = lambda line: None) -> dict:
    """Trials of the top ``k`` of ``found`` on ``launcher`` (module docstring), re-ranked."""
    measured = []
    for i, cand in enumerate(found["candidates"][:k]):
        s = cand["sizes"]
        note(f"trial {i + 1}/{min(k, len(found['candidates']))}: tp {s['tp']} pp {s['pp']} vpp {s['vpp'] or '-'} "
             f"cp {s['cp']} ep {s['ep']} dp {s['dp']} mbs {cand['micro_batch_size']}, {iterations} iterations")
        measured.append(run_trial(launcher, cand["data"], iterations, f"{job_id}-{i}"))
    return rerank(found, measured)


def winner_job(found: dict):
    """The chosen candidate's job and grid (the concrete spec the job then runs)."""
    job = to_job_config(parse_spec(found["candidates"][found["chosen"]]["data"]))
    return job, ParallelGrid.from_config(job.parallel, job.world_size)


def layout_record(found: dict) -> dict:
    """What a job's ``layout`` event records of an auto choice: the chosen candidate and, per
    candidate considered, the predicted and (after trials) measured figures, without spec data."""
    keep = ("sizes", "order", "sequence_parallel", "micro_batch_size", "use_distributed_optimizer",
            "recompute_granularity", "predicted_step_s", "peak_bytes_per_rank", "measured_step_s",
            "measured_peak_bytes", "predicted_rank", "trial_error")
    cands = [{k: c[k] for k in keep if k in c} for c in found["candidates"]]
    return {"chosen": cands[found["chosen"]], "candidates": cands, "trials": found.get("trials", 0),
            "open": found.get("open", [])}


def auto_layout_record(data) -> dict | None:
    """The ``layout`` record of a spec's data with ``auto`` fields (the cost model's choice, no trials;
    the search is the one its validation ran, remembered), or None for a concrete spec."""
    from service.spec.auto import auto_fields
    from service.spec.spec import search_layouts

    if not isinstance(data, dict) or not auto_fields(data):
        return None
    return layout_record(search_layouts(data))


def layout_message(record: dict) -> str:
    """One line for a ``layout`` event: the chosen sizes and how they were chosen."""
    c = record["chosen"]
    sizes = " ".join(f"{k} {v}" for k, v in c["sizes"].items() if v is not None)
    how = (f"fastest of {record['trials']} trials: {c['measured_step_s']:.4g} s per iteration measured, "
           f"{c['predicted_step_s']:.4g} s predicted" if record.get("trials")
           else f"the cost model's best of {len(record['candidates'])}: {c['predicted_step_s']:.4g} s predicted")
    return f"auto layout: {sizes}, micro batch {c['micro_batch_size']} ({how})"
