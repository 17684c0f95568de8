"""One rank of a job as a Ray actor.

The Ray launcher (``service/ranks/ray_launcher.py``, one ``RayRankGroup`` per attempt) creates one
:class:`RankActor` per rank, named ``raytron:<job_id>:rank<r>`` so it shows in ``ray list actors``
and the dashboard, each in its node's placement-group bundle with one GPU. Its life:

1. ``__init__`` imports torch and the training stack at once. Every actor's constructor runs
   concurrently as soon as it is scheduled, so the dominant start-up cost (the torch import,
   ~2 s of CPU per process) overlaps across ranks instead of queueing behind the rendezvous.
2. ``rendezvous_address()`` (rank 0 only): this node's IP and the port of the TCP store it starts
   there and then, listening before any other rank is told where (:func:`~workers.rank.distributed.listening_store`).
3. ``setup(job, ...)``: joins the process group (gloo on CPU, nccl on GPU, with a collective
   timeout so that a silent peer becomes an error), builds the :class:`~workers.train.trainer.Trainer` of
   this attempt's job (the checkpoint it resumes from), and returns its placement record
   (:class:`~workers.rank.placement_record.PlacementRecord`: Ray node id, hostname, pid, device, grid
   coordinates, the checkpoint it resumed from).
4. ``run(n)``: ``n`` iterations (through :class:`~workers.rank.main.RankRunner`, which also fires
   failure drills); returns their metrics and exports each as Ray metrics.
5. ``save_now()``: a checkpoint of the current iteration, committed before it returns (the job
   controller asks for one between calls when a node holding ranks is to be preempted, or a rank
   got a SIGTERM: :mod:`workers.rank.sigterm`, its notice in ``run``'s last metrics).
6. ``stall()``: answered from a second thread while ``run`` is blocked: the group kind a hang
   drill blocked in, or "" (the controller asks a rank that stopped answering).
7. a hot spare (``resources.spare_nodes``, :mod:`service.ranks.spares`) is this actor started
   with no rank, idle after step 1, until ``setup(..., as_rank=r)`` makes it rank r.
8. ``reset()``: after a failed attempt, a rank that survived it forgets the attempt (its trainer
   and process groups) but keeps its process, torch imported, so that the next attempt starts
   it again with ``setup`` instead of a new actor (see ``service/ranks/ray_launcher.py``). It
   keeps its in-memory snapshots and the replicas it holds (``fault_tolerance.memory_interval``,
   :mod:`workers.rank.replicas`): the next attempt restores from them.

Nothing here imports torch or ray at module level: the driver imports this module only to name
the class.
"""

from __future__ import annotations

import os
import traceback

from workers.config import JobConfig
from workers.rank.faults import Fault
from workers.grid import COORDS
from workers.rank.placement_record import PlacementRecord

METRIC_TAGS = ("job_id", "rank", *COORDS)


def actor_name(job_id: str, rank: int) -> str:
    """The Ray actor name of a rank (unique per job)."""
    return f"raytron:{job_id}:rank{rank}"


class RankActor:
    """A rank of ``job``: process-group member, model shard, optimizer and data position.

    Args:
        rank: this rank; the controller assigns it from the placement plan, never from the
            order in which actors happen to start.
        job_id: tags the metrics.
    """

    def __init__(self, rank: int, job_id: str):
        import torch

        # Two cores are shared by every rank on a simulated cluster; on a real node each rank
        # has its GPU and intra-op CPU threads only fight the data loader.
        torch.set_num_threads(1)
        import workers.train.trainer  # noqa: F401 - warm the rest of the stack during the start-up overlap
        import gc

        # What the imports made lives as long as the process: out of the collector's reach, a full
        # collection (reset() after a failure, on every survivor at once) scans only the attempt's objects.
        gc.freeze()

        from workers.rank import sigterm

        self.sigterm = sigterm.install()  # a SIGTERM is a preemption notice, not an exit (workers/rank/sigterm.py)
        from workers.rank.timeline import Timeline

        self.timeline = Timeline()  # what this process did since it started, or since its last attempt failed
        self.rank, self.job_id = rank, job_id
        self.runner = None
        self.memory = None  # in-memory snapshots and replicas (workers.rank.replicas), kept across reset()
        self.stalled_in = ""
        self._gauges: dict = {}
        self._groups: list = []  # the attempt's process groups, freed side by side at reset()
        self._reapers: list = []  # the threads freeing the last attempt's process groups (reset())
        self._store = None  # rank 0: the TCP store of the next setup, started by rendezvous_address()

    def rendezvous_address(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Where the process group meets: this node's IP and the port of the TCP store this rank
        starts now (its ``setup`` joins through it), so that no rank connects before it listens."""
        import ray

        from workers.rank.distributed import listening_store

        ip = ray.util.get_node_ip_address()
        self._store = listening_store(ip, world_size, timeout_s)
        return ip, self._store.port

    def setup(self, job: JobConfig, master_addr: str, master_port: int, world_size: int, local_rank: int,
              collective_timeout_s: float, faults: tuple[Fault, ...] = (), node: int | None = None,
              as_rank: int | None = None) -> PlacementRecord:
        """Join the process group and build the trainer of ``job`` (this attempt's: its size and the
        checkpoint to resume from); returns this rank's placement record. ``as_rank``: a hot spare
        (or a rank turned spare) takes that rank, with no in-memory state of its own."""
        if as_rank is not None:
            self.rank, self.memory = as_rank, None
        import ray
        import torch
        import torch.distributed as dist

        from workers.rank.main import RankRunner
        from workers.rank.distributed import init_distributed, process_groups, rank_device

        timeline = self.timeline
        timeline.idle()
        if torch.cuda.is_available():
            for thread in self._reapers:
                thread.join()  # the last attempt's communicators gone before this one's
        # Ray exposes exactly one GPU to this actor (CUDA_VISIBLE_DEVICES), so any slot maps to it.
        device = rank_device(local_rank)
        with timeline.step("init_process_group"):
            store, self._store = self._store, None
            backend = init_distributed(self.rank, world_size, master_addr, master_port, timeout_s=collective_timeout_s,
                                       store=store if self.rank == 0 else None)
        if self.runner is not None:
            raise RuntimeError(f"rank {self.rank}: setup() twice without reset()")
        from workers.rank.sigterm import arm

        arm(self.sigterm, job.sigterm_grace_s)
        if job.memory_interval and self.memory is None:
            from workers.rank.replicas import MemoryStore

            self.memory = MemoryStore()
        self.runner = RankRunner(job, self.rank, world_size, device=device, faults=faults,
                                 on_stall=self._stalled, node=node, memory=self.memory, timeline=timeline)
        self._groups = process_groups()
        self._make_gauges(self.runner.trainer.coords)
        ctx = ray.get_runtime_context()
        return self.runner.placement(
            node_id=ctx.get_node_id(), node_ip=ray.util.get_node_ip_address(), actor_id=ctx.get_actor_id(),
            backend=backend, world_size=dist.get_world_size(), gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
            local=local_rank, timeline=timeline.to_dict())

    def run(self, iterations: int) -> list[dict]:
        """Train ``iterations`` iterations; returns each one's metrics (the loss is global).

        When they fail, this rank forgets the attempt before it raises (:meth:`reset`): a gloo
        group closes its connections only once nothing refers to it any more, and only then do the
        peers blocked in a collective with this rank fail at once instead of at their timeout; the
        release threads drop the groups' last references while the error travels to the driver."""
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank}: run() before setup()")
        from workers.rank.sigterm import attach

        try:
            return attach(self.sigterm, self.runner.run(iterations, on_metrics=self._export))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, without its frames
            error = exc
        # Outside the handler, so that nothing holds the failed call's frames (and, through them,
        # the trainer and its groups); the traceback travels as text.
        error.add_note("".join(traceback.format_exception(error)).rstrip())
        error.__traceback__ = error.__context__ = error.__cause__ = None
        self.reset()
        raise error

    def save_now(self) -> dict:
        """A checkpoint of the current iteration, committed before this returns (a preemption notice)."""
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank}: save_now() before setup()")
        return self.runner.save_now()

    def stall(self) -> str:
        """The collective a hang drill blocked in ("tp all_reduce"), or ""."""
        return self.stalled_in

    def _stalled(self, where: str) -> None:
        self.stalled_in = where

    def ping(self) -> int:
        return os.getpid()

    def reset(self) -> int:
        """Forget the attempt, keep the process: finish a pending checkpoint write, leave the
        process groups (peers that are gone are not waited for), free the trainer, and answer; the
        groups are freed on threads of their own, side by side (:func:`workers.rank.main.forget_attempt`).
        Returns the pid."""
        import torch.distributed as dist

        from workers.rank.main import forget_attempt

        if self.runner is None and not dist.is_initialized():
            self.stalled_in = ""
            return os.getpid()  # reset already (a failed run() resets before it raises): nothing to free
        self.stalled_in = ""
        from workers.rank.timeline import Timeline

        self.timeline = Timeline()  # a recovery begins
        groups, self._groups = self._groups, []
        self._reapers = forget_attempt(self, groups)
        return os.getpid()

    def _make_gauges(self, coords: dict) -> None:
        from ray.util.metrics import Gauge

        tags = {"job_id": self.job_id, "rank": str(self.rank),
                **{k: str(coords[k]) for k in COORDS}}
        if self._gauges:  # a reused rank: same metrics, this attempt's coordinates
            for gauge in self._gauges.values():
                gauge.set_default_tags(tags)
            return
        for key, name, doc in (("loss", "raytron_lm_loss", "language-model loss of the last iteration"),
                               ("val_loss", "raytron_val_loss", "validation loss of the last evaluation"),
                               ("lr", "raytron_lr", "learning rate the last update applied"),
                               ("grad_norm", "raytron_grad_norm", "global gradient L2 norm before clipping"),
                               ("loss_scale", "raytron_loss_scale", "fp16 dynamic loss scale (1 otherwise)"),
                               ("tokens_per_s", "raytron_tokens_per_s", "global-batch tokens per second"),
                               ("step_time_s", "raytron_step_time_s", "seconds per iteration"),
                               ("peak_mem_mb", "raytron_peak_mem_mb", "this rank's peak memory, MiB")):
            gauge = Gauge(name, description=doc, tag_keys=METRIC_TAGS)
            gauge.set_default_tags(tags)
            self._gauges[key] = gauge

    def _export(self, metrics: dict) -> None:
        for key, gauge in self._gauges.items():
            if metrics.get(key) is not None:  # val_loss only where an evaluation ran; grad_norm None on fp16 overflow
                gauge.set(float(metrics[key]))
