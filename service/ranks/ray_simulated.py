"""A simulated Ray cluster on this machine: a head node with no GPU slots and worker nodes with fake
GPU slots, shaped like a real cluster (see :mod:`service.ranks.ray_cluster`). Its processes carry
:data:`~service.ranks.ray_base.CLUSTER_MARK`, so stopping it finds them all, orphans included; with a
record file it outlives a server that was killed and is re-attached to by the next one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

from service.control.errors import ClusterUnreachable
from service.ranks.proc_tree import marked, orphans, started_at
from service.ranks.proc_tree import reap as _reap
from service.ranks.ray_base import (CLUSTER_MARK, OBJECT_STORE_BYTES, RaySession, check_reachable, environment,
                                    http_url, init_kwargs, local_ray_environment)
from workers.rank.distributed import free_port


@contextlib.contextmanager
def simulated_cluster(nodes: int, gpus: int, *, cpus_per_node: float | None = None,
                      growable: bool = False, record: str | Path | None = None,
                      accelerator: str | None = None) -> Iterator[RaySession]:
    """Start a head node (no GPU slots) and ``nodes`` worker nodes with ``gpus`` fake GPU slots
    each on this machine, and connect.

    Args:
        nodes: worker nodes to start (the nodes a job's ranks run on).
        gpus: GPU slots each worker node declares.
        cpus_per_node: logical CPUs each worker node declares; default ``gpus`` (one per rank
            actor). Ray prestarts that many idle workers per node, so it should not exceed the
            ranks. The head declares none: it holds no ranks.
        growable: the session's :meth:`RaySession.add_node` may start more nodes while it runs
            (fault drills: a lost node that returns). Such a session is not static: a launcher
            waits for a placement that does not fit yet instead of refusing it at once.
        record: a file that describes the running cluster (its address, dashboard, id and shape).
            When it names a cluster of this shape that still answers, that cluster is re-attached
            to instead of starting a new one (a server killed and started again); when it names
            one that is gone, what is left of it is reaped first. Removed when the cluster stops.
        accelerator: label the worker nodes as Ray labels a node of that GPU (its
            ``accelerator_type:<name>`` resource, e.g. ``H100``), as a cluster of such machines
            reports itself (tests of the figures a cluster reports); default none, as on CPU.

    Yields:
        The session; the cluster is shut down, every process of it reaped and its files removed on exit.
    """
    if nodes < 1 or gpus < 1:
        raise ValueError(f"simulate needs at least 1 node and 1 GPU slot, got {nodes}x{gpus}; use e.g. 2x4")
    if record is not None:
        found = _recorded_cluster(Path(record), nodes, gpus)
        if found is not None:
            with _reattached(found, Path(record)) as session:
                yield session
            return
    import ray

    cpus = gpus if cpus_per_node is None else cpus_per_node
    temp_dir = tempfile.mkdtemp(prefix="raytron-ray-")
    cluster_id = uuid.uuid4().hex[:16]
    since = started_at(os.getpid()) or 0  # no process of the cluster started before this one
    cluster = None
    try:
        with local_ray_environment(temp_dir):
            node_args = dict(num_cpus=cpus, num_gpus=gpus, object_store_memory=OBJECT_STORE_BYTES)
            if accelerator:
                node_args["resources"] = {f"accelerator_type:{accelerator}": 1.0}
            with environment({CLUSTER_MARK: cluster_id}):  # only the cluster's processes carry the mark
                # Recorded: the cluster must outlive a server that is killed (no fate sharing with it),
                # so that a server started again re-attaches; otherwise it dies with its process.
                cluster = _start_cluster(nodes, node_args, fate_share=record is None)
            ray.init(address=cluster.address, **init_kwargs())
            url = http_url(cluster.head_node.address_info.get("webui_url") or "")
            if record is not None:
                _write_record(Path(record), {"cluster_id": cluster_id, "address": cluster.address,
                                             "dashboard_url": url, "nodes": nodes, "gpus": gpus,
                                             "temp_dir": temp_dir, "owner": os.getpid(), "since": since})

            def add_node() -> str:
                # Not cluster.wait_for_nodes: it never returns once a node was lost without remove_node.
                with environment({CLUSTER_MARK: cluster_id}):
                    node = cluster.add_node(wait=True, dashboard_agent_listen_port=free_port(), **node_args)
                _wait_alive(node.node_id, timeout_s=60)
                return node.node_id

            yield RaySession(address=cluster.address, dashboard_url=url, owned=True, static=not growable,
                             num_nodes=nodes, single_node=nodes == 1, _add_node=add_node if growable else None)
    finally:
        ray.shutdown()
        if cluster is not None:
            with contextlib.suppress(Exception):  # a node already killed from outside
                cluster.shutdown()
        stop_marked_cluster(cluster_id, temp_dir, record, since=since)


def _start_cluster(nodes: int, node_args: dict, *, fate_share: bool):
    """A head node with no GPU slots and ``nodes`` worker nodes of ``node_args``; all of them up.
    ``fate_share``: the cluster's processes die with this one (Ray's reaper, the kernel's parent-death signal)."""
    from ray.cluster_utils import Cluster

    # Each node's dashboard agent on a port of its own: Ray's fixed default (52365) is taken
    # by whichever agent of any cluster on this machine binds first, and a head node whose
    # agent lost that race cannot accept Ray Jobs ("No available agent to submit job").
    cluster = Cluster(initialize_head=True, shutdown_at_exit=fate_share, head_node_args=dict(
        num_cpus=0, num_gpus=0, object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=True, dashboard_host="127.0.0.1",
        # A simulated node lost for good (its raylet killed) is reported dead in ~3 s, not ~30 s.
        _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 3},
        # None, not Ray's default 8265: lets the dashboard move on when another cluster has it.
        dashboard_port=None, dashboard_agent_listen_port=free_port()))
    for _ in range(nodes):  # nodes boot in parallel; waited for below
        cluster.add_node(wait=False, dashboard_agent_listen_port=free_port(), **node_args)
    cluster.wait_for_nodes(timeout=120)
    return cluster


def join_simulated_cluster(record: str | Path, gpus: int, cpus: float | None = None) -> str:
    """Start one more worker node (``gpus`` fake GPU slots) for the running simulated cluster that
    ``record`` describes, from this process, as a machine joining a real cluster would; returns
    its node id. The node carries the cluster's mark (it is stopped with the cluster) and does not
    die with this process."""
    import ray._private.node
    import ray._private.parameter

    data = json.loads(Path(record).read_text())
    params = ray._private.parameter.RayParams(
        num_cpus=gpus if cpus is None else cpus, num_gpus=gpus, object_store_memory=OBJECT_STORE_BYTES,
        min_worker_port=0, max_worker_port=0, gcs_address=data["address"], include_log_monitor=False,
        node_manager_port=0, dashboard_agent_listen_port=free_port())
    with local_ray_environment(data["temp_dir"]), environment({CLUSTER_MARK: data["cluster_id"]}):
        node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    return node.node_id


def stop_marked_cluster(cluster_id: str, temp_dir: str | None = None, record: str | Path | None = None,
                        since: int | None = None) -> None:
    """Stop every process of the simulated cluster ``cluster_id`` (by its mark, wherever its parent
    went), remove its files and its record. ``since``: when the cluster started (clock ticks since
    boot); the agents of its raylets that were killed (orphans, whose title hides the mark) are
    stopped too."""
    # Rounds: a raylet that is being stopped may still start an agent after the first look.
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0), (signal.SIGKILL, 2.0)):
        pids = marked(CLUSTER_MARK, cluster_id)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        _reap(pids, timeout_s=wait_s)
    if since is not None:
        for pid in orphans(("ray::DashboardAgent", "ray::RuntimeEnvAgent"), since):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)
    if record is not None:
        with contextlib.suppress(OSError):
            Path(record).unlink()


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _write_record(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _recorded_cluster(path: Path, nodes: int, gpus: int) -> dict | None:
    """The recorded cluster when it is of this shape and answers; otherwise None, after reaping
    whatever is left of it (a cluster whose GCS died, or of another shape)."""
    try:
        data = json.loads(path.read_text())
        cluster_id, address = data["cluster_id"], data["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        check_reachable(address, timeout_s=2.0)
        answers = True
    except ClusterUnreachable:
        answers = False
    owner = data.get("owner")
    if answers and owner != os.getpid() and _alive(owner):
        raise ValueError(f"the simulated Ray cluster recorded in {path} belongs to a process that is still running "
                         f"(pid {owner}): stop it first, or use another data dir")
    if answers and (data.get("nodes"), data.get("gpus")) == (nodes, gpus) and marked(CLUSTER_MARK, cluster_id):
        return data
    stop_marked_cluster(cluster_id, data.get("temp_dir"), path, since=data.get("since"))
    return None


@contextlib.contextmanager
def _reattached(data: dict, record: Path) -> Iterator[RaySession]:
    """Connect to the recorded simulated cluster; this process now owns it (stops it on exit)."""
    import ray

    try:
        with local_ray_environment(data["temp_dir"]):
            ray.init(address=data["address"], **init_kwargs())
        _write_record(record, {**data, "owner": os.getpid()})
        session = RaySession(address=data["address"], dashboard_url=data.get("dashboard_url") or "", owned=True,
                             static=True, num_nodes=data["nodes"], single_node=data["nodes"] == 1)
        session.notes.append(f"re-attached to the simulated Ray cluster at {data['address']} that an earlier "
                             f"process started ({data['nodes']} node(s) x {data['gpus']} GPU slot(s))")
        yield session
    finally:
        ray.shutdown()
        stop_marked_cluster(data["cluster_id"], data.get("temp_dir"), record, since=data.get("since"))


def _wait_alive(node_id: str, timeout_s: float) -> None:
    """Until Ray lists node ``node_id`` as alive (with its resources, which the scaling policy counts)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while not any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the added Ray node {node_id} is not alive after {timeout_s:g}s")
        time.sleep(0.1)
