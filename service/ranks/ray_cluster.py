"""Where a job's Ray cluster comes from: an existing one, an embedded one, or a simulated one.

:func:`ray_session` is the one entry point. In order of precedence it

1. reuses the driver's connection when ``ray.init`` was already called (tests, a controller
   running inside a Ray job);
2. starts a *simulated* cluster when asked (``simulate=(nodes, gpus)``), shaped like a real one:
   a head node with no GPU slots (the GCS, the dashboard, and every Ray Job's entry point: a
   job's runner) plus ``nodes`` worker nodes on this machine, each declaring ``gpus`` fake GPU
   slots (Ray sets ``CUDA_VISIBLE_DEVICES`` per actor as on a real node; torch sees no device
   and the ranks train on CPU with gloo). Any worker node can be lost and the job's runner lives
   on. With a ``record`` file (``raytron serve --simulate``: in its data dir) the cluster outlives
   a server that was killed: a server started again re-attaches to it while it lives;
3. connects to ``RAY_ADDRESS`` when it is set;
4. otherwise starts an embedded single-node cluster with this machine's GPUs, or, on a machine
   without GPUs, simulates the job's own shape so that ``raytron run spec.yaml`` just works.

Nothing here prints: what a user should know (a flag ignored, a cluster simulated) is in
:attr:`RaySession.notes`. An address that does not answer fails within
``connect_timeout_s`` with :class:`~service.control.errors.ClusterUnreachable` instead of Ray's
minutes of retries.

Two facts about Ray 2.60 on one machine shape this module (measured on these machines): Ray picks an
address it cannot reach unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is in the environment of
the process that starts it, and a plain local start turns token auth on and writes a token into
the home directory. Every cluster started here gets both variables and its own temporary folder,
all three undone when the session ends.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from service.control.errors import ClusterUnreachable
from service.ranks.proc_tree import children as _children, descendants as _descendants
from service.ranks.proc_tree import reap as _reap
from service.ranks.ray_base import (  # noqa: F401 (CLUSTER_MARK, NAMESPACE, RaySession: this module's interface too)
    CLUSTER_MARK, NAMESPACE, OBJECT_STORE_BYTES, RaySession, check_reachable, http_url, init_kwargs,
    local_ray_environment)
from service.ranks.ray_simulated import join_simulated_cluster, simulated_cluster, stop_marked_cluster  # noqa: F401


def local_gpu_count() -> int:
    """NVIDIA GPUs on this machine, counted from the device files (no CUDA import needed)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


@contextlib.contextmanager
def local_cluster(*, num_gpus: int | None = None) -> Iterator[RaySession]:
    """Start an embedded one-node Ray cluster with this machine's CPUs and GPUs and connect."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="raytron-ray-")
    before = _children(os.getpid())
    ray_processes: set[int] = set()
    try:
        with local_ray_environment(temp_dir):
            ctx = ray.init(include_dashboard=True, dashboard_host="127.0.0.1", num_gpus=num_gpus,
                           object_store_memory=4 * OBJECT_STORE_BYTES, **init_kwargs())
            ray_processes = _children(os.getpid()) - before
            yield RaySession(address=ctx.address_info["gcs_address"], dashboard_url=http_url(ctx.dashboard_url or ""),
                             owned=True, static=True, num_nodes=1, single_node=True)
    finally:
        family = _descendants(ray_processes)
        ray.shutdown()
        _reap(family)
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def connected_cluster(address: str, *, connect_timeout_s: float = 10.0) -> Iterator[RaySession]:
    """Connect to a running cluster (``RAY_ADDRESS``); it may autoscale, so it is not static."""
    import ray

    check_reachable(address, connect_timeout_s)
    with _captured_stderr() as captured:  # Ray's C++ client logs a line per retry while it tries
        try:
            ctx = ray.init(address=address, **init_kwargs())
        except ConnectionError as e:
            raise ClusterUnreachable(f"RAY_ADDRESS={address} accepts connections but no Ray cluster answered "
                                     f"({e}); fix RAY_ADDRESS or unset it to run on an embedded cluster") from None
        notes = [line for line in captured() if line.strip()][:5]  # while the capture file is open
    try:
        session = RaySession(address=address, dashboard_url=http_url(ctx.dashboard_url or ""), owned=False,
                             static=False, num_nodes=_alive_nodes())
        session.notes += notes
        yield session
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _captured_stderr() -> Iterator:
    """Send file descriptor 2 (C++ logging included) to a temporary file; yields a reader of its lines."""
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace").splitlines())[1]
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def ray_session(simulate: tuple[int, int] | None = None, *, default_shape: tuple[int, int] | None = None,
                record: str | Path | None = None) -> Iterator[RaySession]:
    """The cluster a job runs on; see the module docstring for the order of precedence.

    Args:
        simulate: ``(nodes, gpus)`` to start a simulated cluster.
        default_shape: ``(nodes, gpus)`` to simulate when nothing else is given and this
            machine has no GPUs (normally the job's own ``num_nodes x gpus_per_node``).
        record: with ``simulate``, the file that records the simulated cluster so that a process
            started again re-attaches to it (:func:`simulated_cluster`).
    """
    import ray

    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        session = RaySession(address=ctx.gcs_address, dashboard_url=http_url(_dashboard_url()), owned=False,
                             static=False, num_nodes=_alive_nodes())
        if simulate is not None:
            session.notes.append("this process is already connected to Ray; --simulate ignored")
        yield session
        return
    address = os.environ.get("RAY_ADDRESS")
    if simulate is not None:
        with simulated_cluster(*simulate, record=record) as session:
            if address:
                session.notes.append(f"--simulate given, ignoring RAY_ADDRESS={address}")
            yield session
    elif address:
        with connected_cluster(address) as session:
            yield session
    elif local_gpu_count() or default_shape is None:
        with local_cluster() as session:
            yield session
    else:
        nodes, gpus = default_shape
        with simulated_cluster(nodes, gpus) as session:
            session.notes.append(f"no RAY_ADDRESS and no GPU here: simulating {nodes} node(s) x {gpus} GPU "
                                 f"slot(s) on this machine (CPU, gloo)")
            yield session


def _alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _dashboard_url() -> str:
    try:
        import ray

        return ray._private.worker.get_dashboard_url() or ""  # no public getter for a running driver
    except Exception:  # noqa: BLE001 - the URL is informative only
        return ""
