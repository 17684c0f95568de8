"""Watching a driver's own Ray connection, so that a runner cut off from its cluster exits within seconds.

A Ray driver whose raylet dies (its node lost) or whose GCS stops answering (the head node lost)
lives on: Ray's core worker never notices its raylet, and retries the GCS for a minute. A job's
runner in that state can neither create actors nor placement groups, so its next attempt used to
wait out the rendezvous timeout (600 s, measured) before failing with a misleading message.

:class:`ConnectionWatch` probes both, every ``period_s``, in a daemon thread:

* the raylet's local socket: a refused connection (or a socket file gone) means the raylet
  process is dead; that is final at once, but it is confirmed by one more probe;
* the GCS, asked whether this node is alive (``check_alive`` with a timeout): an answer of
  "dead" means the GCS declared this node lost; no answer for ``gcs_grace_s`` means the GCS is gone.

The first condition met calls ``on_lost(reason)`` once, with a line that says what was lost and
where. What to do then is the caller's: the job runner records the failure and exits, so that the
server starts a new runner (:mod:`service.server.job_main`).

The decision (:meth:`ConnectionWatch.judge`) is separate from the probes so that its timing is
tested without a cluster; the probes themselves are tested against a real one
(``tests/service/ranks/test_ray_watch.py``).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("raytron.ray")

GONE_ERRNOS = (errno.ECONNREFUSED, errno.ENOENT)
"""What connecting to a raylet's socket answers once the raylet process is dead (a busy raylet
with a full backlog answers EAGAIN instead: not a loss)."""


@dataclass(frozen=True)
class Probe:
    """One look at the connection.

    Attributes:
        raylet_gone: the raylet's socket refused the connection (or is gone).
        gcs_answered: the GCS answered within the probe's timeout.
        node_dead: the GCS answered that this node is dead.
        detail: what the failed probe said (an error message), for the reason line.
    """

    raylet_gone: bool = False
    gcs_answered: bool = True
    node_dead: bool = False
    detail: str = ""


class ConnectionWatch:
    """Calls ``on_lost(reason)`` once when this driver's raylet or GCS is gone (see the module docstring).

    Args:
        on_lost: receives one line: what was lost, where, and since when.
        probe: one look at the connection; default :meth:`probe_ray` (needs a connected driver).
        period_s: time between probes.
        gcs_grace_s: how long the GCS may stay silent before it counts as gone (a GCS restarted
            by Ray's own fault tolerance is back well within this).
        raylet_probes: consecutive refused probes of the raylet's socket that make it gone.
    """

    def __init__(self, on_lost: Callable[[str], None], *, probe: Callable[[], Probe] | None = None,
                 period_s: float = 1.0, gcs_grace_s: float = 10.0, raylet_probes: int = 2):
        self.on_lost, self.period_s, self.gcs_grace_s, self.raylet_probes = on_lost, period_s, gcs_grace_s, raylet_probes
        self._probe = probe
        self._target: tuple[str, str, str] | None = None  # (node id, raylet socket, GCS address)
        self._gcs_silent_since: float | None = None
        self._raylet_refusals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    # ---- the decision ---------------------------------------------------------------------------
    def judge(self, probe: Probe, now: float) -> str | None:
        """Take one probe taken at ``now`` (monotonic seconds); the reason the connection is lost, or None."""
        node, sock, gcs = self._target or ("this node", "its socket", "the head node")
        self._raylet_refusals = self._raylet_refusals + 1 if probe.raylet_gone else 0
        if self._raylet_refusals >= self.raylet_probes:
            return (f"this node's raylet is gone (node {node}: {sock} refused {self._raylet_refusals} connections "
                    f"in a row{': ' + probe.detail if probe.detail else ''}); the node was lost")
        if probe.node_dead:
            return f"the GCS at {gcs} reports this node ({node}) dead; the node was lost"
        if probe.gcs_answered:
            self._gcs_silent_since = None
            return None
        if self._gcs_silent_since is None:
            self._gcs_silent_since = now
        silent = now - self._gcs_silent_since
        if silent >= self.gcs_grace_s:
            return (f"the GCS at {gcs} has not answered for {silent:.0f}s"
                    f"{' (' + probe.detail + ')' if probe.detail else ''}; the head node was lost")
        return None

    # ---- the probes -----------------------------------------------------------------------------
    def probe_ray(self, timeout_s: float = 2.0) -> Probe:
        """Probe this process's Ray connection: its raylet's socket, then the GCS about this node."""
        import ray
        from ray._raylet import NodeID

        worker = ray._private.worker.global_worker
        if self._target is None:
            self._target = (ray.get_runtime_context().get_node_id(), worker.node.raylet_socket_name,
                            worker.gcs_client.address)
        node_id, sock_path, _ = self._target
        raylet_gone, detail = False, ""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect(sock_path)
            except OSError as e:
                raylet_gone, detail = e.errno in GONE_ERRNOS, e.strerror or str(e)
        try:
            alive = worker.gcs_client.check_alive([NodeID.from_hex(node_id)], timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - Ray's RpcError: the GCS did not answer in time
            return Probe(raylet_gone=raylet_gone, gcs_answered=False, detail=detail or _first_line(e))
        return Probe(raylet_gone=raylet_gone, node_dead=not all(alive), detail=detail)

    # ---- the thread -----------------------------------------------------------------------------
    def start(self) -> "ConnectionWatch":
        probe = self._probe or self.probe_ray
        probe()  # the first look names the target (and fails loudly when not connected)
        if self._target is not None:
            log.info("watching the Ray connection of node %s (raylet socket %s, GCS %s)", *self._target)
        self._thread = threading.Thread(target=self._run, args=(probe,), name="raytron-ray-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period_s + 5)

    def _run(self, probe: Callable[[], Probe]) -> None:
        while not self._stop.wait(self.period_s):
            try:
                reason = self.judge(probe(), time.monotonic())
            except Exception as e:  # noqa: BLE001 - a probe that cannot even run says nothing about Ray
                log.warning("Ray connection probe failed: %s", _first_line(e))
                continue
            if reason is not None and not self._stop.is_set():
                self.lost = reason
                self.on_lost(reason)
                return

    def __enter__(self) -> "ConnectionWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
