"""A rank's recovery timeline: wall and CPU seconds of each step from a failed attempt to the next attempt's trainer.

A Ray rank actor (:mod:`workers.rank.actor`) records, per attempt, what it did since the last one
failed: leaving the attempt (``leave groups``: the checkpoint writer finished and torch.distributed
left; ``free trainer``: the trainer dropped and the garbage collected), how long it then waited for
the driver (``idle``, with the CPU it spent meanwhile: a hot spare's imports or Ray's threads), and
the next ``setup``'s steps (``init_process_group``, ``trainer`` with the Megatron groups it builds
shown apart, ``restore``).
The record travels in the rank's placement record (``timeline``), so the recovery benchmark
(``bench/recovery_kills.py``) prints where a restart's time goes per rank. CPU seconds are the
process's (every thread), wall seconds the step's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class Timeline:
    """The steps of one recovery, in order: ``[(name, wall_s, cpu_s), ...]``, plus when it began."""

    def __init__(self):
        self.steps: list[tuple[str, float, float]] = []
        self.began = time.time()  # wall clock, comparable with the driver's
        self._mark = (time.perf_counter(), time.process_time())

    @contextmanager
    def step(self, name: str):
        """Record the wall and CPU seconds of the ``with`` body as step ``name``."""
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - w0, time.process_time() - c0)
            self._mark = (time.perf_counter(), time.process_time())

    def add(self, name: str, wall_s: float, cpu_s: float) -> None:
        self.steps.append((name, round(wall_s, 4), round(cpu_s, 4)))

    def idle(self, name: str = "idle") -> None:
        """Record the time since the last step ended (waiting for the driver) as step ``name``."""
        w0, c0 = self._mark
        self.add(name, time.perf_counter() - w0, time.process_time() - c0)
        self._mark = (time.perf_counter(), time.process_time())

    def to_dict(self) -> dict:
        """``{"began": wall clock, "steps": [[name, wall_s, cpu_s], ...]}`` (JSON-able)."""
        return {"began": self.began, "steps": [list(s) for s in self.steps]}


__all__ = ["Timeline"]
