"""Opening the launcher a job's ranks run under: local processes or Ray actors (``--launcher``).

"Launcher" means one thing everywhere: where the ranks run. ``raytron run --launcher``,
``raytron serve --launcher`` and the job runner's own ``--launcher`` name the same choice, and
:func:`open_launcher` is the one place that turns it into a :class:`~service.control.jobs.Launcher`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

LAUNCHERS = ("processes", "ray")
"""The choices of every ``--launcher`` flag: local processes, or Ray actors on a Ray cluster."""


@contextlib.contextmanager
def open_launcher(kind: str, *, shape: tuple[int, int], simulate: tuple[int, int] | None = None,
                  note: Callable[[str], None] = lambda line: None,
                  on_ray_lost: Callable[[str], None] | None = None) -> Iterator:
    """The launcher of ``kind``, open for the ``with`` block (a Ray connection is closed after it).

    Args:
        kind: ``processes`` (:class:`~service.ranks.process_launcher.ProcessLauncher`) or ``ray``
            (:class:`~service.ranks.ray_launcher.RayLauncher` on the cluster
            :func:`~service.ranks.ray_cluster.ray_session` finds or starts).
        shape: the job's ``(num_nodes, gpus_per_node)``: the shape of an embedded cluster.
        simulate: ``--simulate NODESxGPUS``: start a simulated cluster of that shape.
        note: receives the session's notes (what was started, the dashboard's address).
        on_ray_lost: with ``ray``, called once (from a watch thread) with the reason when this
            process's raylet or GCS is gone (:class:`~service.ranks.ray_watch.ConnectionWatch`):
            a driver cut off from its cluster can neither start ranks nor learn that it cannot.
            None: not watched.
    """
    if kind not in LAUNCHERS:
        raise ValueError(f"launcher {kind!r}: expected one of {', '.join(LAUNCHERS)}")
    if kind == "processes":
        from service.ranks.process_launcher import ProcessLauncher

        yield ProcessLauncher()
        return
    from service.ranks.ray_cluster import ray_session
    from service.ranks.ray_launcher import RayLauncher
    from service.ranks.ray_watch import ConnectionWatch

    with ray_session(simulate, default_shape=shape) as session:
        for line in session.notes:
            note(line)
        if session.dashboard_url:
            note(f"Ray dashboard {session.dashboard_url}")
        with ConnectionWatch(on_ray_lost) if on_ray_lost is not None else contextlib.nullcontext():
            yield RayLauncher(session)
