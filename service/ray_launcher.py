"""``--launcher ray``: a job's ranks as Ray actors, driven by the job controller.

:class:`RayLauncher` holds the process's one Ray connection (a :class:`~service.ray_cluster.RaySession`)
and builds a :class:`RayRankGroup` per attempt, from a fresh placement plan (so a later attempt
may have another size). One attempt:

1. a placement group with one bundle per node of the plan (``{"GPU": gpus_per_node, "CPU": ...}``,
   STRICT_SPREAD), waited for with a timeout; a job that cannot fit fails with needed vs
   available nodes and GPUs;
2. one :class:`~workers.rank_actor.RankActor` per rank, in the bundle of its planned node, one
   GPU each; the rank comes from the plan, never from the order in which actors start. All are
   created at once so that their torch imports overlap;
3. rendezvous: rank 0 reports its node IP and a free port; every rank joins the process group
   and builds its trainer;
4. ``run(n)`` on every rank, collected by :func:`service.gather.collect` (the same failure
   triage as the process launcher: root cause first, a silent rank named as hung);
5. shutdown: kill the actors, wait until Ray knows they are dead, remove the placement group.
"""

from __future__ import annotations

from dataclasses import replace

from service.controller import ControllerConfig
from service.errors import InsufficientResources, RankDied, RankRaised
from service.gather import collect
from service.placement import RankPlacement, plan_placement
from service.ray_cluster import RaySession
from workers.config import JobConfig
from workers.faults import Fault
from workers.grid import ParallelGrid


class RayRankGroup:
    """The rank actors of one attempt (see the module docstring). Needs a connected driver."""

    def __init__(self, job: JobConfig, grid: ParallelGrid, plan: list[RankPlacement], *, job_id: str,
                 config: ControllerConfig):
        if len(plan) != grid.world_size:
            raise ValueError(f"placement plan has {len(plan)} ranks but the grid has {grid.world_size}")
        self.job, self.grid, self.plan, self.job_id, self.config = job, grid, plan, job_id, config
        self.actors: list = []
        self.pg = None
        self.placement: list[dict] = []
        self._inflight: list = []  # refs of the last call, drained at shutdown

    def start(self, faults: list[Fault]) -> list[dict]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.rank_actor import RankActor, actor_name

        cfg, job = self.config, self.job
        bundle = {"GPU": job.gpus_per_node, "CPU": cfg.cpus_per_rank * job.gpus_per_node}
        if cfg.static_cluster and not _could_ever_fit(job, cfg.strategy, bundle):
            raise InsufficientResources(capacity_message(job, cfg, bundle, waited=False))
        self.pg = placement_group([dict(bundle) for _ in range(job.num_nodes)], strategy=cfg.strategy,
                                  name=f"raytron:{self.job_id}")
        if not self.pg.wait(timeout_seconds=cfg.placement_timeout_s):
            raise InsufficientResources(capacity_message(job, cfg, bundle))
        remote_cls = ray.remote(RankActor)
        self.actors = [
            remote_cls.options(
                name=actor_name(self.job_id, p.rank), num_gpus=1, num_cpus=cfg.cpus_per_rank, max_restarts=0,
                max_concurrency=2,  # a second thread answers stall() while run() is blocked
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=p.node),
            ).remote(job, p.rank, self.job_id)
            for p in self.plan
        ]
        addr, port = self._collect([self.actors[0].rendezvous_address.remote()], cfg.start_timeout_s,
                                   what="rendezvous")[0]
        timeout = float(job.collective_timeout_s)
        self.placement = self._collect(
            [a.setup.remote(addr, port, self.grid.world_size, p.local, timeout, tuple(faults))
             for a, p in zip(self.actors, self.plan)], cfg.start_timeout_s, what="start")
        self.placement = [{**rec, "node": p.node} for rec, p in zip(self.placement, self.plan)]
        return self.placement

    def run(self, iterations: int) -> list[list[dict]]:
        return self._collect([a.run.remote(iterations) for a in self.actors], None, stall_s=self.job.collective_timeout_s,
                             what="run")

    def kill(self) -> None:
        import ray

        for actor in list(self.actors):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead is fine
                pass

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        actors = list(self.actors)
        self.kill()
        self.actors = []
        if actors:
            # A call on a killed actor fails once the GCS knows it is dead; after this wait no
            # rank of the job shows as alive in `ray list actors`.
            ray.wait([a.ping.remote() for a in actors], num_returns=len(actors), timeout=30)
        # Read the answers a failed call left behind, so Ray does not log them as unhandled errors.
        inflight, self._inflight = self._inflight, []
        if inflight:
            ray.wait(inflight, num_returns=len(inflight), timeout=10)
            for ref in inflight:
                try:
                    ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - the failure was reported already
                    pass
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _collect(self, refs: list, timeout_s: float | None, *, stall_s: float | None = None, what: str) -> list:
        import ray

        rank_of = dict(zip(refs, range(len(refs))))
        ref_of = {r: ref for ref, r in rank_of.items()}
        self._inflight = list(refs)

        def poll(pending: set[int], timeout: float | None) -> list[tuple[int, object]]:
            ready, _ = ray.wait([ref_of[r] for r in pending], num_returns=1, timeout=timeout)
            return [(rank_of[ref], self._outcome(ref, rank_of[ref])) for ref in ready]

        out = collect(list(range(len(refs))), poll, where=self._where, grace_s=self.config.failure_grace_s,
                      stall_s=stall_s, timeout_s=timeout_s, stall_hint=self._stall_hint, what=what)
        return [out[r] for r in range(len(refs))]

    def _outcome(self, ref, rank: int):
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(ref)
        except RayActorError as exc:
            where = self._where(rank)
            lost = " (its node is lost: Ray reports it dead)" if where.get("node_id") in _dead_nodes() else ""
            return RankDied(rank, where, (_summary(exc) or "actor died") + lost)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None) or exc
            return RankRaised(rank, self._where(rank), f"{type(cause).__name__}: {_summary(cause)}", str(exc))

    def _stall_hint(self, rank: int) -> str:
        """Ask a silent rank's second thread what it is blocked in (a hang drill knows; SIGSTOP does not answer)."""
        import ray

        try:
            return ray.get(self.actors[rank].stall.remote(), timeout=2)
        except Exception:  # noqa: BLE001 - not knowable
            return ""

    def _where(self, rank: int) -> dict:
        c = self.grid.coords(rank)
        where = {"node": self.plan[rank].node}
        for p in self.placement:
            if p["rank"] == rank:
                where.update(node_id=p["node_id"], pid=p["pid"])
        return {**where, **{k: c[k] for k in ("tp", "pp", "dp", "cp", "ep")}}


class RayLauncher:
    """Builds a :class:`RayRankGroup` per attempt over one Ray session (``start_job(launcher=...)``).

    Args:
        session: the connected cluster (:func:`service.ray_cluster.ray_session`).
        config: timeouts and resources; by default a short placement timeout on a cluster started
            here (nothing can join it later) and a long one on ``RAY_ADDRESS``.
    """

    name = "ray"

    def __init__(self, session: RaySession, config: ControllerConfig | None = None):
        self.session = session
        self.config = config or ControllerConfig(
            placement_timeout_s=15.0 if session.static else 300.0, static_cluster=session.static,
            strategy="PACK" if session.single_node else "STRICT_SPREAD")

    def make_group(self, job: JobConfig, grid: ParallelGrid, attempt: int, *, job_id: str) -> RayRankGroup:
        plan = plan_placement(grid, job.gpus_per_node, job.num_nodes)
        config = self.config
        if attempt and job.min_nodes is not None:
            # An elastic job after a failure: a node that does not come back within node_grace_s
            # makes the controller shrink the job rather than wait out the placement timeout.
            config = replace(config, placement_timeout_s=min(config.placement_timeout_s, max(10.0, job.node_grace_s)))
        return RayRankGroup(job, grid, plan, job_id=job_id, config=config)

    def nodes_available(self, gpus_per_node: int) -> int:
        """Alive nodes with at least ``gpus_per_node`` GPUs (what the scaling policy may use)."""
        return sum(1 for r in _node_totals() if r.get("GPU", 0) >= gpus_per_node)


def _dead_nodes() -> set[str]:
    import ray

    try:
        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
    except Exception:  # noqa: BLE001 - only an annotation
        return set()


def _node_totals() -> list[dict]:
    import ray

    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def _could_ever_fit(job: JobConfig, strategy: str, bundle: dict) -> bool:
    """Whether the cluster's total (not free) resources can hold the bundles at all."""
    holds = []  # bundles each node could hold if it were empty
    for r in _node_totals():
        n = int(r.get("GPU", 0) // bundle["GPU"])
        holds.append(min(n, int(r.get("CPU", 0) // bundle["CPU"])) if bundle["CPU"] else n)
    if strategy == "STRICT_SPREAD":
        return sum(1 for h in holds if h >= 1) >= job.num_nodes
    return sum(holds) >= job.num_nodes


def capacity_message(job: JobConfig, cfg: ControllerConfig, bundle: dict, waited: bool = True) -> str:
    """Why a placement group does not fit: what the job needs next to what the cluster has."""
    import ray

    totals = _node_totals()
    gpus = [int(r.get("GPU", 0)) for r in totals]
    fitting = sum(1 for g in gpus if g >= job.gpus_per_node)
    free = ray.available_resources().get("GPU", 0)
    distinct = "distinct " if cfg.strategy == "STRICT_SPREAD" else ""
    when = f"waited {cfg.placement_timeout_s:g}s" if waited else "no node can join this cluster"
    return (f"the job does not fit the cluster: it needs {job.num_nodes} {distinct}node(s) with "
            f"{job.gpus_per_node} GPU(s) and {bundle['CPU']:g} CPU(s) each ({job.num_nodes * job.gpus_per_node} "
            f"GPUs); the cluster has {len(totals)} node(s) with GPUs {gpus}, {fitting} of them with >= "
            f"{job.gpus_per_node} GPUs, {free:g} GPU(s) free ({when}). Lower resources.num_nodes or "
            f"gpus_per_node, or add nodes (--simulate NODESxGPUS locally)")


def _summary(exc: BaseException) -> str:
    """First line of a Ray error, plus its last line when that is the underlying exception."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] if len(lines) == 1 or lines[-1] in lines[0] else f"{lines[0]} ... {lines[-1]}"
