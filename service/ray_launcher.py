"""`raytron run --launcher ray`: a job's ranks as Ray actors, driven by the job controller.

:func:`run_on_ray` finds or starts the cluster (:mod:`service.ray_cluster`), prints the
dashboard URL and the placement the actors report, shows progress, and returns the contract-3
result. :class:`RayRankGroup` is the Ray side of one attempt:

1. a placement group with one bundle per node of the plan (``{"GPU": gpus_per_node, "CPU": ...}``,
   STRICT_SPREAD), waited for with a timeout; a job that cannot fit fails with needed vs
   available nodes and GPUs;
2. one :class:`~workers.rank_actor.RankActor` per rank, in the bundle of its planned node, one
   GPU each; the rank comes from the plan, never from the order in which actors start. All are
   created at once so that their torch imports overlap;
3. rendezvous: rank 0 reports its node IP and a free port; every rank joins the process group
   and builds its trainer;
4. ``run(n)`` on every rank; the first failure (with a short grace to find the root cause among
   the ranks it brings down: a dead actor beats its peers' "connection closed") is a
   :class:`~service.controller.RankError`;
5. shutdown: kill the actors, wait until Ray knows they are dead, remove the placement group.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from service.controller import (ControllerConfig, JobController, JobError, JobEvent, InsufficientResources, RankDied,
                                RankError, RankRaised)
from service.placement import RankPlacement
from workers.config import JobConfig
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

    def start(self, faults: dict[int, tuple[int, str]]) -> list[dict]:
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
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=p.node),
            ).remote(job, p.rank, self.job_id)
            for p in self.plan
        ]
        addr, port = self._gather([self.actors[0].rendezvous_address.remote()], [0], cfg.start_timeout_s)[0]
        for rank, (iteration, kind) in faults.items():
            self.actors[rank].inject_fault.remote(iteration, kind)  # queued before setup on the same actor
        self.placement = self._gather(
            [a.setup.remote(addr, port, self.grid.world_size, p.local, cfg.collective_timeout_s)
             for a, p in zip(self.actors, self.plan)], None, cfg.start_timeout_s)
        return self.placement

    def run(self, iterations: int) -> list[list[dict]]:
        # No deadline here: the collective timeout inside the ranks is the hang detector.
        return self._gather([a.run.remote(iterations) for a in self.actors], None, None)

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
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _gather(self, refs: list, ranks: list[int] | None, timeout_s: float | None) -> list:
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = dict(zip(refs, ranks))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending, failures = list(refs), []
        while pending and not failures:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not ready:
                missing = sorted(rank_of[r] for r in pending)
                raise JobError(f"ranks {missing} did not answer within {timeout_s:.0f}s")
            failures += self._failures(ready, rank_of)
        if failures:
            # A rank's death reaches its gloo peers ("connection closed by peer") about as fast as
            # it reaches the driver: give the root cause a moment to arrive before naming a rank.
            grace_end = time.monotonic() + self.config.failure_grace_s
            while pending and not any(_is_root_cause(e) for e in failures) and time.monotonic() < grace_end:
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, grace_end - time.monotonic()))
                failures += self._failures(ready, rank_of)
            raise min(failures, key=lambda e: (not isinstance(e, RankDied), not _is_root_cause(e),
                                               failures.index(e)))
        return ray.get(refs)

    def _failures(self, ready: list, rank_of: dict) -> list[RankError]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        out: list[RankError] = []
        for ref in ready:
            rank = rank_of[ref]
            try:
                ray.get(ref)
            except RayActorError as exc:
                out.append(RankDied(rank, self._where(rank), _summary(exc) or "actor died"))
            except RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                out.append(RankRaised(rank, self._where(rank), f"{type(cause).__name__}: {_summary(cause)}",
                                      str(exc)))
        return out

    def _where(self, rank: int) -> dict:
        where = {"node": self.plan[rank].node}
        for p in self.placement:
            if p["rank"] == rank:
                where.update(node_id=p["node_id"], pid=p["pid"])
        return where


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


_PEER_SYMPTOMS = ("closed by peer", "reset by peer", "broken pipe", "timed out", "socket closed",
                  "connection refused")


def _is_root_cause(error: RankError) -> bool:
    """A death, or an exception that is not merely a peer's collective breaking under it."""
    return isinstance(error, RankDied) or not any(s in error.cause.lower() for s in _PEER_SYMPTOMS)


def _summary(exc: BaseException) -> str:
    """First line of a Ray error, plus its last line when that is the underlying exception."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] if len(lines) == 1 or lines[-1] in lines[0] else f"{lines[0]} ... {lines[-1]}"


def run_on_ray(job: JobConfig, grid: ParallelGrid, plan: list[RankPlacement], *,
               simulate: tuple[int, int] | None = None, progress: bool = False, job_id: str | None = None,
               config: ControllerConfig | None = None, on_event: Callable[[JobEvent], None] | None = None,
               controller_hook: Callable[[JobController], None] | None = None) -> dict:
    """Run a job on Ray and wait for it; returns the contract-3 result object.

    Args:
        job, grid, plan: the validated job, its grid and placement plan (``service.runner.prepare``).
        simulate: ``(nodes, gpus)``: start a simulated local cluster (see :mod:`service.ray_cluster`).
        progress: show a progress bar (stderr).
        job_id: default a fresh one.
        config: timeouts and resources; by default a short placement timeout on a cluster started
            here (nothing can join it later) and a long one on ``RAY_ADDRESS``.
        on_event: also receives every controller event (e.g. for a job store).
        controller_hook: called with the controller before it runs (cancel, fault injection).

    Returns:
        The result; on failure ``state`` is FAILED and ``error`` says which rank and why.
    """
    from service.ray_cluster import ray_session
    from service.runner import Progress, new_job_id, print_placement

    job_id = job_id or new_job_id(job)
    with ray_session(simulate, default_shape=(job.num_nodes, job.gpus_per_node)) as session:
        if config is None:
            config = ControllerConfig(placement_timeout_s=15.0 if session.static else 300.0,
                                      static_cluster=session.static,
                                      strategy="PACK" if session.single_node else "STRICT_SPREAD")
        if session.dashboard_url:
            print(f"raytron: Ray dashboard {session.dashboard_url}  (job {job_id})", file=sys.stderr)
        bar = None

        def handle(event: JobEvent) -> None:
            nonlocal bar
            if event.kind == "placement":
                print_placement(event.data["placement"])
                bar = Progress(job.training.train_iters, progress, job.name)
            elif event.kind == "iteration" and bar is not None:
                bar(0, {"event": "iteration", **event.data})
            elif event.kind == "failure":
                print(f"raytron: {event.message}", file=sys.stderr)
            if on_event is not None:
                on_event(event)

        controller = JobController(
            job, grid, job_id=job_id, on_event=handle, iterations_per_call=config.iterations_per_call,
            make_group=lambda attempt: RayRankGroup(job, grid, plan, job_id=job_id, config=config))
        if controller_hook is not None:
            controller_hook(controller)
        try:
            return controller.run()
        finally:
            if bar is not None:
                bar.close()
