"""``--launcher ray``: a job's ranks as Ray actors, driven by the job controller.

:class:`RayLauncher` holds the process's one Ray connection (a :class:`~service.ranks.ray_cluster.RaySession`)
and builds a :class:`RayRankGroup` per attempt, from a fresh placement plan (so a later attempt
may have another size). One attempt:

1. a placement group with one bundle per node of the plan (``{"GPU": gpus_per_node, "CPU": ...}``,
   STRICT_SPREAD), waited for with a timeout; a job that cannot fit fails with needed vs
   available nodes and GPUs;
2. one :class:`~workers.rank.actor.RankActor` per rank, in the bundle of its planned node, one
   GPU each; the rank comes from the plan, never from the order in which actors start. All are
   created at once so that their torch imports overlap;
3. rendezvous: rank 0 starts its TCP store and reports its node IP and port; every rank joins the process group
   and builds its trainer;
4. ``run(n)`` on every rank, collected by :func:`service.ranks.gather.collect` (the same failure
   triage as the process launcher: root cause first, a silent rank named as hung);
5. shutdown: kill the actors, wait until Ray knows they are dead, remove the placement group.

A restart after a rank failure does not start over (``shutdown(keep_warm=True)``): the ranks that
survived the attempt (their call returned or raised, their node is alive) ``reset`` (leave the
process groups, free the trainer) and wait, with the placement group, in the launcher
(:class:`WarmRanks`; which ones: :func:`service.ranks.ray_survivors.survivors_of`). The next attempt of the same size reuses them and creates actors only for
the ranks that died, in their bundles: it pays one torch import instead of one per rank (the
bulk of a restart). A rank that does not answer within ``LauncherConfig.reuse_wait_s`` (hung,
stopped) is killed like the dead ones; a resize means a full teardown, and so does a lost node
unless the job keeps its state in memory (``fault_tolerance.memory_interval``): then the ranks on
the nodes left stay, and the lost node's ranks start in its bundle, which Ray moves to another node
(every actor answers a ping before the setup calls go out, so a new one cancelled fails the attempt
with the kept ranks untouched).
With hot spares (``resources.spare_nodes``, :mod:`service.ranks.spares`) the placement group holds
the spare nodes' bundles too, and a node that lost a rank moves whole onto a spare node's started
actors instead of new ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from service.control.rank_group import LauncherConfig
from service.control.errors import InsufficientResources, RankDied, RankRaised
from service.control.recovery import KeptRanks
from service.ranks.gather import collect
from service.spec.placement import RankPlacement, plan_placement
from service.ranks.ray_cluster import RaySession
from service.ranks.ray_actors import WarmRanks, clear_leftovers, rank_actor_class, error_summary as _summary, kill_actors, kill_and_wait
from service.ranks.ray_drain import SigtermNotices, draining_nodes, schedulable_totals
from service.ranks.spares import SPARE_START_WAIT_S, Spares, spare_ranks
from service.ranks.ray_survivors import survivors_of
from service.ranks.ray_nodes import capacity_message, could_ever_fit, dead_nodes, wait_placed
from workers.config import JobConfig
from workers.rank.faults import Fault
from workers.grid import COORDS, ParallelGrid
from workers.rank.placement_record import PlacementRecord



class RayRankGroup:
    """The rank actors of one attempt (see the module docstring). Needs a connected driver.

    Args:
        warm: ranks kept from the previous attempt; used when their shape matches this one's,
            released otherwise.
        park: takes this attempt's survivors at ``shutdown(keep_warm=True)`` (the launcher keeps
            them for the next attempt); None: never kept.
    """

    def __init__(self, job: JobConfig, grid: ParallelGrid, plan: list[RankPlacement], *, job_id: str,
                 config: LauncherConfig, warm: WarmRanks | None = None,
                 park: Callable[[WarmRanks], None] | None = None, shrink_when_short: bool = False):
        if len(plan) != grid.world_size:
            raise ValueError(f"placement plan has {len(plan)} ranks but the grid has {grid.world_size}")
        self.job, self.grid, self.plan, self.job_id, self.config = job, grid, plan, job_id, config
        self.warm, self._park, self.shrink_when_short = warm, park, shrink_when_short
        self.key = (job.num_nodes, job.gpus_per_node, config.cpus_per_rank, tuple(plan))
        self.actors: list = []
        self.pg = None
        self.spares: Spares | None = None  # the hot spares (resources.spare_nodes), from _place() or the warm ranks
        self.placement: list[PlacementRecord] = []
        self.reused: list[int] = []  # ranks this attempt took over from the previous one
        self._inflight: list = []  # refs of the last call, drained at shutdown
        self._ran = False  # run() was called: the in-flight refs are one per rank
        self._setup_sent = False  # start() sent its setup calls: a kept rank may be in this attempt's groups
        self.sigterms = SigtermNotices(job_id)
        self.notices = self.sigterms.notices  # rank -> deadline of the ranks that got a SIGTERM (a preemption notice)

    def start(self, faults: list[Fault]) -> list[dict]:
        cfg, job = self.config, self.job
        warm, self.warm = self.warm, None
        if warm is not None and warm.key != self.key:
            warm.release()  # another shape (a resize): its bundles are not this attempt's
            warm = None
        if warm is not None:
            self.pg, kept, self.spares = warm.pg, warm.actors, warm.spares
        else:
            self._place()
            kept = {}
        taken = spare_ranks(self.plan, kept, self.spares, min(SPARE_START_WAIT_S, cfg.start_timeout_s))  # whole nodes moved onto hot spares
        self.reused = sorted(kept)
        self.actors = [taken.get(p.rank) or kept.get(p.rank) or self._new_actor(p) for p in self.plan]
        if job.memory_interval and (kept or taken):
            # New actors up before any setup goes out: one cancelled (its bundle moving off a lost
            # node) then fails this attempt with the kept ranks untouched, their in-memory state kept.
            self._collect([a.ping.remote() for a in self.actors], cfg.start_timeout_s, what="start")
        timeout = float(job.collective_timeout_s)
        addr, port = self._collect([self.actors[0].rendezvous_address.remote(self.grid.world_size, timeout)],
                                   cfg.start_timeout_s, what="rendezvous")[0]
        self._setup_sent = True
        records = self._collect(
            [a.setup.remote(job, addr, port, self.grid.world_size, p.local, timeout, tuple(faults), p.node,
                            p.rank if p.rank in taken else None)
             for a, p in zip(self.actors, self.plan)], cfg.start_timeout_s, what="start")
        self.placement = [replace(rec, node=p.node, reused=p.rank in kept, spare=p.rank in taken)
                          for rec, p in zip(records, self.plan)]
        return [record.to_dict() for record in self.placement]

    def _place(self) -> None:
        from ray.util.placement_group import placement_group

        cfg, job = self.config, self.job
        bundle = {"GPU": job.gpus_per_node, "CPU": cfg.cpus_per_rank * job.gpus_per_node}
        held = replace(job, num_nodes=job.num_nodes + job.spare_nodes)  # the spares hold nodes of their own
        spares = f" (resources.spare_nodes {job.spare_nodes} included: lower it)" if job.spare_nodes else ""
        if cfg.static_cluster and not could_ever_fit(held, cfg.strategy, bundle):
            raise InsufficientResources(capacity_message(held, cfg, bundle, waited=False) + spares)
        clear_leftovers(self.job_id, len(self.plan))
        self.pg = placement_group([dict(bundle) for _ in range(held.num_nodes)], strategy=cfg.strategy,
                                  name=f"raytron:{self.job_id}")
        # an elastic job's retry stops waiting once the alive nodes cannot hold it: its controller shrinks it
        fits = (lambda: could_ever_fit(held, cfg.strategy, bundle)) if self.shrink_when_short else None
        if not wait_placed(self.pg, cfg.placement_timeout_s, fits):
            raise InsufficientResources(capacity_message(held, cfg, bundle) + spares)
        if job.spare_nodes:
            self.spares = Spares(self.pg, job.num_nodes, job.spare_nodes, job.gpus_per_node, self._spare_actor)

    def _new_actor(self, p: RankPlacement):
        """Rank ``p.rank``'s actor in its node's bundle. All are created before any is waited for,
        so that their torch imports overlap."""
        from workers.rank.actor import actor_name

        name = actor_name(self.job_id, p.rank)
        if self.spares is not None:  # ranks and spares trade places: a name of each actor's own
            import uuid

            name += f"-{uuid.uuid4().hex[:8]}"
        return self._actor(self.spares.slots[p.node] if self.spares is not None else p.node, p.rank, name)

    def _spare_actor(self, pg, bundle: int):
        """A hot spare: a rank actor with no rank yet (its torch import starts now)."""
        import uuid

        return self._actor(bundle, -1, f"raytron:{self.job_id}:spare-{uuid.uuid4().hex[:8]}", pg)

    def _actor(self, bundle: int, rank: int, name: str, pg=None):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return rank_actor_class().options(
            name=name, num_gpus=1, num_cpus=self.config.cpus_per_rank, max_restarts=0,
            max_concurrency=2,  # a second thread answers stall() while run() is blocked
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg if pg is None else pg, placement_group_bundle_index=bundle),
        ).remote(rank, self.job_id)

    def placement_extra(self) -> dict:
        """What the placement event carries beside the ranks: the hot spares, when the job has some."""
        return {"spares": self.spares.view()} if self.spares is not None else {}

    def run(self, iterations: int) -> list[list[dict]]:
        first, self._ran = not self._ran, True
        out = self._collect([a.run.remote(iterations) for a in self.actors], None, stall_s=self.job.collective_timeout_s,
                            what="run")
        if first and self.spares is not None:
            self.spares.refill()  # after the restore and a first call, not competing with them
        self.sigterms.take(out, self.placement)  # rank actors that got a SIGTERM: their nodes are drained
        return out

    def save_now(self) -> list[dict]:
        """Every rank saves a checkpoint of the current iteration, committed when this returns (a preemption)."""
        return self._collect([a.save_now.remote() for a in self.actors], self.config.start_timeout_s, what="save")

    def kill(self) -> None:
        kill_actors(list(self.actors))

    def shutdown(self, keep_warm: bool = False) -> None:
        from ray.util.placement_group import remove_placement_group

        survivors = survivors_of(self) if keep_warm and self._park is not None else {}
        doomed = [a for r, a in enumerate(self.actors) if r not in survivors]
        self.actors = []
        kill_and_wait(doomed)
        self._drain()
        if self.warm is not None:  # start() never ran
            self.warm.release()
            self.warm = None
        if self.pg is None:
            return
        spares, self.spares = self.spares, None
        if survivors:
            self._park(WarmRanks(self.key, self.pg, survivors, spares))
        else:
            if spares is not None:
                spares.release()
            remove_placement_group(self.pg)
        self.pg = None

    def _drain(self) -> None:
        """Read the answers a failed call left behind, so Ray does not log them as unhandled errors."""
        import ray

        inflight, self._inflight = self._inflight, []
        if inflight:
            ray.wait(inflight, num_returns=len(inflight), timeout=10)
            for ref in inflight:
                try:
                    ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - the failure was reported already
                    pass

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
            record = self._record(rank)
            lost = " (its node is lost: Ray reports it dead)" if record and record.node_id in dead_nodes() else ""
            return RankDied(rank, self._where(rank), (_summary(exc) or "actor died") + lost)
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

    def _record(self, rank: int) -> PlacementRecord | None:
        """The rank's placement record in this attempt, once every rank has reported one."""
        return self.placement[rank] if rank < len(self.placement) else None

    def _where(self, rank: int) -> dict:
        """Node, Ray node id, pid and coordinates of a rank, for its failure (before the ranks
        reported their records: the plan's node and the grid's coordinates)."""
        record = self._record(rank)
        if record is not None:
            return record.where()
        c = self.grid.coords(rank)
        return {"node": self.plan[rank].node, **{k: c[k] for k in COORDS}}


class RayLauncher:
    """Builds a :class:`RayRankGroup` per attempt over one Ray session (``start_job(launcher=...)``).

    Args:
        session: the connected cluster (:func:`service.ranks.ray_cluster.ray_session`).
        config: timeouts and resources; by default a short placement timeout on a cluster started
            here (nothing can join it later) and a long one on ``RAY_ADDRESS``.
    """

    name = "ray"
    drain_notices = staticmethod(draining_nodes)  # nodes Ray is draining -> deadlines (a preemption notice)
    saves_on_notice = True  # a drain notice saves a checkpoint: jobs get a checkpoint.dir

    def __init__(self, session: RaySession, config: LauncherConfig | None = None):
        self.session = session
        self._warm = KeptRanks()  # job id -> ranks kept for its next attempt (WarmRanks)
        self.config = config or LauncherConfig(
            placement_timeout_s=15.0 if session.static else 300.0, static_cluster=session.static,
            call_target_s=1.0,  # a driver round trip per second of iterations, not per iteration
            strategy="PACK" if session.single_node else "STRICT_SPREAD")

    def make_group(self, job: JobConfig, grid: ParallelGrid, attempt: int, *, job_id: str) -> RayRankGroup:
        plan = plan_placement(grid, job.gpus_per_node, job.num_nodes)
        config, elastic_retry = self.config, bool(attempt and job.min_nodes is not None)
        if elastic_retry:
            # An elastic job after a failure: a node that does not come back within node_grace_s
            # makes the controller shrink the job rather than wait out the placement timeout; a
            # cluster whose alive nodes cannot hold it ends the wait at once (wait_placed).
            config = replace(config, placement_timeout_s=min(config.placement_timeout_s, max(10.0, job.node_grace_s)))
        return RayRankGroup(job, grid, plan, job_id=job_id, config=config, warm=self._warm.take(job_id),
                            park=lambda warm: self._warm.park(job_id, warm), shrink_when_short=elastic_retry)

    def release(self, job_id: str) -> None:
        """The job is over: kill the ranks kept warm for its next attempt, free their placement group."""
        self._warm.release(job_id)

    def nodes_available(self, gpus_per_node: int) -> int:
        """Alive nodes with at least ``gpus_per_node`` GPUs, not being drained (what the scaling policy may use)."""
        return sum(1 for r in schedulable_totals() if r.get("GPU", 0) >= gpus_per_node)
