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
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from service.control.errors import ClusterUnreachable
from service.ranks.proc_tree import children as _children, descendants as _descendants, marked, orphans, started_at
from service.ranks.proc_tree import reap as _reap
from workers.rank.distributed import free_port

NAMESPACE = "raytron"
CLUSTER_MARK = "RAYTRON_RAY_CLUSTER"
"""Set (to the cluster's id) in the environment of every process of a simulated cluster: its
GCS, raylets, dashboard, agents, workers and Ray Jobs inherit it, so stopping the cluster finds
them all by it (:func:`~service.ranks.proc_tree.marked`), orphans of a killed raylet included."""
_OBJECT_STORE_BYTES = 100 * 2**20  # per simulated node; rank actors pass almost nothing through it


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


def local_gpu_count() -> int:
    """NVIDIA GPUs on this machine, counted from the device files (no CUDA import needed)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


@contextlib.contextmanager
def _local_ray_environment(temp_dir: str) -> Iterator[None]:
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


def _init_kwargs() -> dict:
    # Warnings only: INFO lines from ray.init would bury the progress bar.
    return {"namespace": NAMESPACE, "logging_level": "warning", "configure_logging": True}


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
        with _local_ray_environment(temp_dir):
            node_args = dict(num_cpus=cpus, num_gpus=gpus, object_store_memory=_OBJECT_STORE_BYTES)
            if accelerator:
                node_args["resources"] = {f"accelerator_type:{accelerator}": 1.0}
            with _environment({CLUSTER_MARK: cluster_id}):  # only the cluster's processes carry the mark
                # Recorded: the cluster must outlive a server that is killed (no fate sharing with it),
                # so that a server started again re-attaches; otherwise it dies with its process.
                cluster = _start_cluster(nodes, node_args, fate_share=record is None)
            ray.init(address=cluster.address, **_init_kwargs())
            url = _http(cluster.head_node.address_info.get("webui_url") or "")
            if record is not None:
                _write_record(Path(record), {"cluster_id": cluster_id, "address": cluster.address,
                                             "dashboard_url": url, "nodes": nodes, "gpus": gpus,
                                             "temp_dir": temp_dir, "owner": os.getpid(), "since": since})

            def add_node() -> str:
                # Not cluster.wait_for_nodes: it never returns once a node was lost without remove_node.
                with _environment({CLUSTER_MARK: cluster_id}):
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
        num_cpus=0, num_gpus=0, object_store_memory=_OBJECT_STORE_BYTES,
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
        num_cpus=gpus if cpus is None else cpus, num_gpus=gpus, object_store_memory=_OBJECT_STORE_BYTES,
        min_worker_port=0, max_worker_port=0, gcs_address=data["address"], include_log_monitor=False,
        node_manager_port=0, dashboard_agent_listen_port=free_port())
    with _local_ray_environment(data["temp_dir"]), _environment({CLUSTER_MARK: data["cluster_id"]}):
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
        with _local_ray_environment(data["temp_dir"]):
            ray.init(address=data["address"], **_init_kwargs())
        _write_record(record, {**data, "owner": os.getpid()})
        session = RaySession(address=data["address"], dashboard_url=data.get("dashboard_url") or "", owned=True,
                             static=True, num_nodes=data["nodes"], single_node=data["nodes"] == 1)
        session.notes.append(f"re-attached to the simulated Ray cluster at {data['address']} that an earlier "
                             f"process started ({data['nodes']} node(s) x {data['gpus']} GPU slot(s))")
        yield session
    finally:
        ray.shutdown()
        stop_marked_cluster(data["cluster_id"], data.get("temp_dir"), record, since=data.get("since"))


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
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


def _wait_alive(node_id: str, timeout_s: float) -> None:
    """Until Ray lists node ``node_id`` as alive (with its resources, which the scaling policy counts)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while not any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the added Ray node {node_id} is not alive after {timeout_s:g}s")
        time.sleep(0.1)


@contextlib.contextmanager
def local_cluster(*, num_gpus: int | None = None) -> Iterator[RaySession]:
    """Start an embedded one-node Ray cluster with this machine's CPUs and GPUs and connect."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="raytron-ray-")
    before = _children(os.getpid())
    ray_processes: set[int] = set()
    try:
        with _local_ray_environment(temp_dir):
            ctx = ray.init(include_dashboard=True, dashboard_host="127.0.0.1", num_gpus=num_gpus,
                           object_store_memory=4 * _OBJECT_STORE_BYTES, **_init_kwargs())
            ray_processes = _children(os.getpid()) - before
            yield RaySession(address=ctx.address_info["gcs_address"], dashboard_url=_http(ctx.dashboard_url or ""),
                             owned=True, static=True, num_nodes=1, single_node=True)
    finally:
        family = _descendants(ray_processes)
        ray.shutdown()
        _reap(family)
        shutil.rmtree(temp_dir, ignore_errors=True)


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


@contextlib.contextmanager
def connected_cluster(address: str, *, connect_timeout_s: float = 10.0) -> Iterator[RaySession]:
    """Connect to a running cluster (``RAY_ADDRESS``); it may autoscale, so it is not static."""
    import ray

    check_reachable(address, connect_timeout_s)
    with _captured_stderr() as captured:  # Ray's C++ client logs a line per retry while it tries
        try:
            ctx = ray.init(address=address, **_init_kwargs())
        except ConnectionError as e:
            raise ClusterUnreachable(f"RAY_ADDRESS={address} accepts connections but no Ray cluster answered "
                                     f"({e}); fix RAY_ADDRESS or unset it to run on an embedded cluster") from None
        notes = [line for line in captured() if line.strip()][:5]  # while the capture file is open
    try:
        session = RaySession(address=address, dashboard_url=_http(ctx.dashboard_url or ""), owned=False,
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
        session = RaySession(address=ctx.gcs_address, dashboard_url=_http(_dashboard_url()), owned=False,
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


def _http(url: str) -> str:
    return url if not url or url.startswith("http") else f"http://{url}"
