"""What every Ray cluster a job runs on shares: the :class:`RaySession` a job gets, the environment
a cluster is started or joined in (loopback addresses, no token file, its own temporary folder),
and a fast check that an address answers. Where the cluster comes from is
:mod:`service.ranks.ray_cluster`; a simulated one is :mod:`service.ranks.ray_simulated`."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

from service.control.errors import ClusterUnreachable


NAMESPACE = "raytron"
CLUSTER_MARK = "RAYTRON_RAY_CLUSTER"
"""Set (to the cluster's id) in the environment of every process of a simulated cluster: its
GCS, raylets, dashboard, agents, workers and Ray Jobs inherit it, so stopping the cluster finds
them all by it (:func:`~service.ranks.proc_tree.marked`), orphans of a killed raylet included."""
OBJECT_STORE_BYTES = 100 * 2**20  # per simulated node; rank actors pass almost nothing through it


@dataclass
class RaySession:
    """What a job runs on.

    Attributes:
        address: the GCS address the driver is connected to.
        dashboard_url: ``http://host:port`` of the dashboard, or "" when there is none.
        owned: True when this session started the cluster (and will stop it).
        static: True when no node can join later (a cluster started here, unless simulated
            with ``growable=True``), so a placement group that does not fit now never will.
        num_nodes: alive nodes when the session began.
        single_node: True when the cluster started here is one node (placement may then PACK a
            multi-node job onto it).
        notes: lines for the user (a flag that was ignored, a cluster simulated).
    """

    address: str
    dashboard_url: str
    owned: bool
    static: bool
    num_nodes: int
    single_node: bool = False
    notes: list[str] = field(default_factory=list)
    _add_node: Callable[[], str] | None = field(default=None, repr=False, compare=False)

    def add_node(self) -> str:
        """Start one more node shaped like the others and wait until Ray reports it alive; returns
        its node id. Only a simulated cluster started with ``growable=True`` (so not static) can:
        the drill of a lost node that returns."""
        if self._add_node is None:
            raise RuntimeError("this Ray session cannot add nodes (only simulated_cluster(..., growable=True) can)")
        return self._add_node()


@contextlib.contextmanager
def local_ray_environment(temp_dir: str) -> Iterator[None]:
    """Loopback-only addresses, no auth token file, Ray's files under ``temp_dir``; restored after."""
    wanted = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": temp_dir}
    # Keep a token-auth set-up that the user configured completely; anything else would make Ray
    # write ~/.ray/auth_token, which then leaks into every later cluster on this machine.
    if not (os.environ.get("RAY_AUTH_MODE", "").lower() == "token" and os.environ.get("RAY_AUTH_TOKEN")):
        wanted["RAY_AUTH_MODE"] = "disabled"
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    # Ray reads the cluster switch once, when ray is first imported; if this process imported
    # ray before (a test, the API server), the module constant must follow the variable.
    constants = sys.modules.get("ray._private.ray_constants")
    saved_flag = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
    # A head node started in-process installs a SIGTERM handler that kills the cluster and calls
    # sys.exit(1) wherever the main thread happens to be; the caller owns signals (a SIGTERM
    # cancels the job and then stops this cluster in order).
    import ray._private.utils as ray_utils

    saved_handler_setter = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = saved_handler_setter
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if constants is not None:
            constants.ENABLE_RAY_CLUSTER = saved_flag


def init_kwargs() -> dict:
    # Warnings only: INFO lines from ray.init would bury the progress bar.
    return {"namespace": NAMESPACE, "logging_level": "warning", "configure_logging": True}


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the ``with`` block (the processes it starts inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast when a ``host:port`` GCS address does not accept a connection within ``timeout_s``."""
    if "://" in address or address == "auto":
        return  # ray:// clients and "auto" are resolved by Ray itself
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except ValueError:
        raise ClusterUnreachable(f"RAY_ADDRESS={address!r} is not host:port; unset it or fix it") from None
    except OSError as e:
        raise ClusterUnreachable(f"the Ray cluster at RAY_ADDRESS={address} did not answer within {timeout_s:g}s "
                                 f"({e.strerror or e}); start it, fix RAY_ADDRESS, or unset it to run on an "
                                 f"embedded cluster") from None


def http_url(url: str) -> str:
    return url if not url or url.startswith("http") else f"http://{url}"
