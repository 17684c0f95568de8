"""What ``raytron run`` shows as a job goes: the progress bar, failures and restarts, the final line.

:class:`RunView` subscribes to a job's :class:`~service.control.events.JobEvent` stream; the controller
never calls it directly (it only emits events, and any number of views may follow them). Tables
and the bar go to stderr, so that stdout carries only the result (the final line, or the JSON
object with ``--json``). The rank tables are in :mod:`api.cli.tables`.
"""

from __future__ import annotations

import json
import sys

from api.cli.tables import print_reported_placement
from service.control.events import JobEvent, JobState


class RunView:
    """Renders a job's events: placement table, a tqdm bar per attempt, failures and restarts.

    Args:
        total: the job's train_iters.
        name: the bar's label.
        quiet: ``--json``: only failures and restarts (one line each) reach stderr.
    """

    def __init__(self, total: int, name: str, *, quiet: bool, out=None):
        self.total, self.name, self.quiet = total, name, quiet
        self.out = out or sys.stderr
        self.bar = None

    def __call__(self, event: JobEvent) -> None:
        if event.kind == "placement" and not self.quiet:
            print_reported_placement(event.data["placement"], self.out)
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.name, unit="it", file=self.out, dynamic_ncols=True)
        elif event.kind == "iteration" and self.bar is not None:
            self.bar.set_postfix(progress_postfix(event.data), refresh=False)
            # by iteration number, not +1: an attempt resumed from a checkpoint continues the count
            self.bar.update(event.data.get("iteration", self.bar.n + 1) - self.bar.n)
        elif event.kind == "failure":
            self.close()
            print(f"raytron: {event.message}", file=self.out)
        elif event.kind == "state" and event.state is JobState.RESTARTING:
            print(f"raytron: {event.message.split(' after: ')[0]}", file=self.out)
        elif event.kind == "state" and event.state is JobState.STARTING and "from_checkpoint" in event.data:
            where = event.data["from_checkpoint"] or "iteration 0 (no checkpoint yet)"
            if event.data["from_checkpoint"] or "(attempt" in event.message:
                print(f"raytron: a new attempt from {where}", file=self.out)
        elif event.kind in ("resize", "waiting", "layout", "tracking", "restore", "preempted") or (event.kind == "state" and event.state is JobState.QUEUED
                                        and "checkpoints" in event.message and not self.quiet):
            print(f"raytron: {event.message}", file=self.out)
        if event.kind == "state" and event.state.is_terminal:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress_postfix(metrics: dict) -> dict:
    """The progress bar's figures for one iteration's metrics: loss, validation loss (when an
    evaluation ran), learning rate, gradient norm, loss scale (fp16), tokens/s and, on chat data, the
    loss tokens of the step and the share of row slots holding a token."""
    out = {"loss": _num(metrics.get("loss"), ".4f")}
    if metrics.get("val_loss") is not None:
        out["val"] = _num(metrics["val_loss"], ".4f")
    if metrics.get("lr") is not None:
        out["lr"] = _num(metrics["lr"], ".2e")
    if metrics.get("grad_norm") is not None:
        out["gnorm"] = _num(metrics["grad_norm"], ".3f")
    if metrics.get("loss_scale") not in (None, 1.0):
        out["scale"] = _num(metrics["loss_scale"], ".0f")
    out["tok_s"] = _num(metrics.get("tokens_per_s") or 0.0, ".0f")
    if metrics.get("packing_efficiency") is not None:  # chat data: loss tokens per step, rows filled
        out["loss_tok"] = _num(metrics.get("loss_tokens"), ".0f")
        out["packed"] = _num(metrics["packing_efficiency"], ".2f")
    return out


def _num(value, fmt: str) -> str:
    return "nan" if value is None else format(value, fmt)


def final_line(result: dict, seconds: float, note: str = "") -> str:
    """``JOB: STATE after N iterations in Ts; loss a -> b`` (stdout)."""
    losses = [x for x in result["losses"] if x is not None]
    curve = f"; loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
    restarts = f", {result['restarts']} restart(s)" if result.get("restarts") else ""
    return (f"{result['job_id']}: {result['state']} after {result['iterations']} iterations in {seconds:.1f}s"
            f"{restarts}{curve}{f' ({note})' if note else ''}")


def result_json(result: dict) -> str:
    """The ``--json`` line; ``allow_nan=False``: a NaN that slipped through is a bug, not output."""
    return json.dumps(result, allow_nan=False)


