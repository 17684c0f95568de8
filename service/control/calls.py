"""How many iterations one ``RankGroup.run`` call covers: the driver's round trips against the
granularity of progress and of failures.

A call is one round trip from the driver to every rank and back (on Ray: a remote call per rank,
its results gathered). With short iterations that round trip is a real share of the step, so a
call may cover several iterations, each still reported with its own metrics when the call
returns. :class:`CallSizer` sizes each call to about ``target_s`` seconds of iterations, from the
time per iteration the previous call measured, and never past the next checkpoint save: the
iterations of a call are recorded when it returns, and a restart resumes from the latest
checkpoint whose iterations were recorded, so a call that ended at a save keeps the promise that a
failure loses at most the iterations since the last checkpoint. Growing back after a resize is
decided at a save too, so calls end where it can happen. In-memory snapshots
(``fault_tolerance.memory_interval``) do not end calls: each rank keeps the metrics of the
iterations it finished in the call under way beside its snapshots, and a restore from memory hands
those of a failed call back to the driver (:mod:`workers.rank.replicas`), so a call of many
iterations loses none of them.

A failure drill's iteration (``--fault RANK@ITER``) is a call of its own: the controller takes a
failed call's first iteration as the one that failed, to spend the drills it reached (each fires
once), which holds when the drill is alone in its call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass
class CallSizer:
    """The size of each run call (see the module docstring).

    Attributes:
        minimum: iterations per call at least (``LauncherConfig.iterations_per_call``).
        target_s: seconds of iterations a call should cover; 0: every call is ``minimum``.
        save_interval: the job's ``checkpoint.save_interval`` (None: no saves to end calls at).
        s_per_iteration: the last measured time per iteration (None before the first call).
    """

    minimum: int = 1
    target_s: float = 0.0
    save_interval: int | None = None
    s_per_iteration: float | None = None

    def size(self, iteration: int, left: int, alone: Iterable[int] = ()) -> int:
        """Iterations for the next call, after ``iteration`` with ``left`` still to run (>= 1);
        ``alone``: iterations that must each be a call of their own (the pending drills')."""
        if iteration + 1 in alone:
            return 1
        n = max(1, self.minimum)
        if self.target_s > 0 and self.s_per_iteration:
            n = max(n, int(self.target_s / self.s_per_iteration))
        if self.save_interval:
            n = min(n, self.save_interval - iteration % self.save_interval)
        for it in alone:
            if it > iteration + 1:
                n = min(n, it - 1 - iteration)  # stop just before it
        return max(1, min(n, left))

    def new_attempt(self) -> None:
        """An attempt starts: its first call is one iteration (after a restart the job's progress
        shows at once, and the time per iteration of its new size or nodes is measured anew)."""
        self.s_per_iteration = None

    def measured(self, iterations: int, seconds: float) -> None:
        """A call of ``iterations`` took ``seconds`` (the first call of an attempt, one iteration,
        takes its warm-up: the next is sized from it and measured again)."""
        if iterations > 0 and seconds > 0:
            self.s_per_iteration = seconds / iterations
