"""A SIGTERM to a Ray rank actor's process taken as a preemption notice, as a rank process takes it under ``--launcher processes``.

Schedulers and clouds announce the end of a node by sending its processes SIGTERM and killing them a
grace period later. Ray's worker loop installs a SIGTERM handler that exits the process, which the
job would see as a rank failure (a restart, counted in ``max_restarts``, from the last checkpoint).
:func:`install` replaces it, in the actor's constructor (Ray runs it in the worker process's main
thread, where Python signal handlers are installed and run), with a
:class:`~workers.rank.main.SigtermNotice`: the process does not exit, it notes the signal's time and
deadline (``fault_tolerance.sigterm_grace_s`` later, set by :func:`arm` at each setup). The actor's
next ``run`` answer carries the notice (:func:`attach`, in its last iteration's metrics), the driver
takes it out (:func:`take_notices`), and the job controller saves the current iteration and leaves
the node (:mod:`service.control.preemption`; the Ray launcher asks Ray to drain the node, so nothing
new is placed there). A second SIGTERM, or the deadline, ends the process.
"""

from __future__ import annotations

import threading

from workers.rank.main import SigtermNotice

KEY = "sigterm_notice"  # where a run's last metrics carry the notice to the driver
DEFAULT_GRACE_S = 30.0  # until the first setup says the job's fault_tolerance.sigterm_grace_s


def install() -> SigtermNotice | None:
    """Take this process's SIGTERM as a notice; None where that cannot be done (not the main thread:
    Python installs signal handlers there only, and Ray's own handler stays)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return SigtermNotice(DEFAULT_GRACE_S).install()


def arm(notice: SigtermNotice | None, grace_s: float) -> None:
    """The job's grace period (``fault_tolerance.sigterm_grace_s``), for a SIGTERM still to come."""
    if notice is not None:
        notice.grace_s = grace_s


def attach(notice: SigtermNotice | None, metrics: list[dict]) -> list[dict]:
    """``metrics`` (a run's answer), its last iteration's carrying the notice when a SIGTERM came."""
    taken = notice.take() if notice is not None and metrics else None
    if taken is not None:
        metrics[-1][KEY] = taken
    return metrics


def take_notices(per_rank: list[list[dict]]) -> dict[int, float | None]:
    """Rank -> deadline of the ranks whose answer carries a notice, taken out of their metrics."""
    out = {}
    for rank, metrics in enumerate(per_rank):
        for m in metrics:
            if KEY in m:
                out[rank] = m.pop(KEY)["deadline"]
    return out


__all__ = ["KEY", "arm", "attach", "install", "take_notices"]
