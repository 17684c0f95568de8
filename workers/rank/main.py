"""What one rank runs, whoever started it: a local rank process, a Ray actor, or torchrun.

:class:`RankRunner` wraps the :class:`~workers.train.trainer.Trainer` (the seam to the training code):
it loads the attempt's checkpoint (``job.checkpoint.resume_from``, chosen by the controller),
runs iterations, saves a checkpoint every ``checkpoint.save_interval`` iterations (every rank
at the same iteration, through one :class:`~workers.checkpoint.checkpointer.Checkpointer`), fires failure
drills (:mod:`workers.rank.faults`) at the right iteration, and when anything raises it tears down
this rank's process groups at once, so that peers blocked in a collective with it see
"connection closed" now instead of waiting for their timeout. :meth:`RankRunner.placement` is
the rank's placement record (:mod:`workers.rank.placement_record`), whoever started it.
:func:`torchrun_env` reads the standard torchrun variables so that ``torchrun
--nproc-per-node N $(which raytron) run SPEC --launcher processes`` runs the same code.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable

from workers.config import JobConfig
from workers.rank.distributed import leave_process_groups, release_in_background
from workers.rank.faults import Fault, crash_in_save, trigger
from workers.grid import COORDS
from workers.rank.placement_record import PlacementRecord


class RankRunner:
    """One rank's trainer plus its failure drills.

    Args:
        job: the job.
        rank: this rank (torch.distributed is initialised when world_size > 1).
        world_size: ranks in the job.
        device: where to compute.
        faults: drills for this rank (others are ignored).
        on_stall: told the group kind when a ``hang`` drill blocks (a side channel to the launcher).
    """

    def __init__(self, job: JobConfig, rank: int, world_size: int, device=None, *, faults=(),
                 on_stall: Callable[[str], None] | None = None, node=None, memory=None, timeline=None):
        from workers.rank.timeline import Timeline
        from workers.train.trainer import Trainer

        self.rank, self.job = rank, job
        mine = [f for f in faults if f.rank == rank]
        self.faults = {f.iteration: f for f in mine if f.kind != "save"}
        self.save_faults = {f.iteration: f for f in mine if f.kind == "save"}
        self.on_stall = on_stall
        timeline = timeline or Timeline()
        with timeline.step("trainer"):
            self.trainer = Trainer(job, rank, world_size, device=device)
        timeline.add("  of which megatron groups", *self.trainer.groups_s)
        ckpt = job.checkpoint
        self.resumed = {"iteration": 0, "path": None, "load_s": 0.0, "note": None, "caught_up": None}
        self.replicator = None
        if job.memory_interval and world_size > 1:
            with timeline.step("restore"):
                self.resumed.update(self._recover_from_memory(node, memory))
        if ckpt.resume_from and not (self.resumed["path"] or "").startswith("memory"):
            from workers.checkpoint.reader import load_checkpoint
            from workers.hf.interop import open_source

            t0 = time.perf_counter()
            loaded = load_checkpoint(self.trainer, open_source(ckpt.resume_from))
            self.resumed.update(loaded, load_s=time.perf_counter() - t0)
        self.checkpointer = self._checkpointer() if ckpt.save_interval and ckpt.dir else None
        self.hf_copies = None
        megatron = ckpt.save_format == "megatron"
        if self.checkpointer is not None and (ckpt.save_hf or megatron) and rank == 0:
            from workers.rank.hf_copies import HFCopies

            total = job.training.train_iters
            self.hf_copies = HFCopies(ckpt.dir, ckpt.save_hf_interval, total - total % ckpt.save_interval,
                                      tokenizer=ckpt.hf_tokenizer, hf=ckpt.save_hf, megatron=megatron)

    def _checkpointer(self):
        from workers.checkpoint.checkpointer import Checkpointer

        ckpt = self.job.checkpoint
        return Checkpointer(ckpt.dir, keep_last=ckpt.keep_last, keep_best=ckpt.keep_best, best_metric=ckpt.best_metric,
                            async_save=ckpt.async_save, timeout_s=max(60.0, 2 * self.job.collective_timeout_s))

    def save_now(self) -> dict:
        """Save a checkpoint of the current iteration now and return once it is committed, whatever
        ``save_interval`` says (a preemption notice: :mod:`service.control.preemption`); collective, every
        rank at the same iteration. Returns the iteration, the seconds it took and (rank 0) the commit's
        retention; {} without ``checkpoint.dir`` or before the first iteration."""
        ckpt, it = self.job.checkpoint, self.trainer.iteration
        if not ckpt.dir or it == 0:
            return {}
        t0 = time.perf_counter()
        if self.checkpointer is None:
            self.checkpointer = self._checkpointer()
        self.checkpointer.wait()  # a pending async save of an earlier iteration first
        if not (ckpt.save_interval and it % ckpt.save_interval == 0):  # else this iteration's save is done
            self.checkpointer.save(self.trainer)
            self.checkpointer.wait()
        return {"iteration": it, "save_s": round(time.perf_counter() - t0, 4),
                "retention": self.checkpointer.take_retention()}

    def _recover_from_memory(self, node, memory) -> dict:
        """Join the in-memory replication (:mod:`workers.rank.replicas`) and restore the newest iteration
        complete in memory when it is not older than the disk checkpoint the controller chose
        (collective). Returns what ``self.resumed`` takes."""
        from workers.rank.replicas import MemoryStore, Replicator

        job, t0 = self.job, time.perf_counter()
        node = self.rank // max(1, job.gpus_per_node) if node is None else node
        self.replicator = Replicator(MemoryStore() if memory is None else memory, self.trainer, node,
                                     job.memory_replicas)
        got = self.replicator.recover(job.memory_upto)
        disk = disk_iteration(job.checkpoint.resume_from)
        if got["iteration"] is None:
            return {"note": got["why"] if job.memory_upto else None}
        if disk is not None and disk > got["iteration"]:
            return {"note": f"the disk checkpoint of iteration {disk} is newer than memory's {got['iteration']}"}
        return {"iteration": got["iteration"], "path": f"memory ({got['source']})", "load_s": time.perf_counter() - t0,
                "note": f"ranks {got['from_replicas']} from their replicas" if got["from_replicas"] else None,
                "caught_up": got["caught_up"] if self.rank == 0 else None}

    def placement(self, **where) -> PlacementRecord:
        """This rank's placement record: this process (host, pid, device), its grid coordinates
        and the checkpoint this attempt started from; ``where`` adds what the caller knows
        beyond the process (its slot ``local``, and on Ray the node id, actor, ...)."""
        c = self.trainer.coords
        return PlacementRecord(
            rank=self.rank, hostname=socket.gethostname(), pid=os.getpid(), device=str(self.trainer.device),
            **{k: c[k] for k in (*COORDS, "etp", "expert_dp")},
            resumed_iteration=self.resumed["iteration"], resumed_from=self.resumed["path"],
            load_s=round(self.resumed["load_s"], 4), restore_note=self.resumed["note"],
            caught_up=self.resumed["caught_up"], **where)

    def run(self, iterations: int, on_metrics: Callable[[dict], None] | None = None) -> list[dict]:
        """``iterations`` iterations; returns their metrics. On any error the groups are torn down."""
        out = []
        if self.replicator is not None:
            self.replicator.store.finished.clear()  # the driver recorded every iteration before this call
        try:
            for _ in range(iterations):
                fault = self.faults.pop(self.trainer.iteration + 1, None)
                if fault is not None:
                    trigger(fault, self.on_stall)
                metrics = self.trainer.train_step()
                self._maybe_save(metrics)
                if self.replicator is not None:
                    if self.trainer.iteration % self.job.memory_interval == 0:
                        metrics.update(self.replicator.snapshot())
                    self.replicator.store.finished[self.trainer.iteration] = dict(metrics)  # if this call fails
                if on_metrics is not None:
                    on_metrics(metrics)
                out.append(metrics)
        except BaseException:
            if self.replicator is not None:
                self.replicator.store.settle(wait=False)  # keep the replicas that arrived whole
            leave_process_groups()  # peers fail fast: the groups go as nothing else holds them
            raise
        return out

    def _maybe_save(self, metrics: dict) -> None:
        """Save after every save_interval-th iteration (all ranks agree: same iteration counter);
        the last iteration waits for an async save so the job ends with a complete checkpoint."""
        if self.checkpointer is None:
            return
        it, interval = self.trainer.iteration, self.job.checkpoint.save_interval
        if interval and it % interval == 0:  # none: a checkpointer made by save_now alone
            fault = self.save_faults.pop(it, None)
            if fault is not None:
                crash_in_save(self.checkpointer)
            if self.hf_copies is not None:
                self.hf_copies.wait()  # nothing it reads may be pruned by this save's commit
            t0 = time.perf_counter()
            self.checkpointer.save(self.trainer, {"val_loss": metrics.get("val_loss"), "lm_loss": metrics.get("loss")})
            metrics["checkpoint_save_s"] = round(time.perf_counter() - t0, 4)
            metrics["checkpoint_bytes"] = int(self.checkpointer.last_stats.get("bytes", 0))
        if it >= self.job.training.train_iters:
            self.checkpointer.wait()
        retention = self.checkpointer.take_retention()  # rank 0, after a commit (an async one: later)
        if retention is not None:
            metrics["checkpoint_retention"] = retention
            if self.hf_copies is not None:
                self.hf_copies.committed(retention["iteration"])
        if self.hf_copies is not None:
            if it >= self.job.training.train_iters:
                self.hf_copies.wait()  # the job ends with its last copy written
            if done := self.hf_copies.take_done():
                metrics["checkpoint_hf"] = done

    def close(self) -> None:
        """Finish a pending async save, release the trainer (see :meth:`Trainer.close`)."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.wait()
            if self.hf_copies is not None:
                self.hf_copies.wait()
        finally:
            self.trainer.close()


class SigtermNotice:
    """A SIGTERM with a grace period, taken as a preemption notice: the rank does not exit, it
    notes when the signal came and its deadline (``grace_s`` later, when whoever sent it kills the
    process: Kubernetes' terminationGracePeriodSeconds, Slurm's KillWait); the rank's host tells the
    driver after its call (:meth:`take`), and the job controller saves the current iteration and
    leaves (:mod:`service.control.preemption`). A second SIGTERM, or the deadline, ends the process.
    Only a process's main thread can install it."""

    def __init__(self, grace_s: float):
        self.grace_s, self._notice = grace_s, None

    def install(self) -> "SigtermNotice":
        import signal

        signal.signal(signal.SIGTERM, self._received)
        return self

    def _received(self, signum, frame) -> None:
        import signal

        if self._notice is None:  # the first one sets the deadline
            now = time.time()
            self._notice = {"signal": "SIGTERM", "time": now, "deadline": now + self.grace_s}
            # A second SIGTERM ends the process, and so does the deadline (SIGALRM's default action),
            # so that a SIGTERM meant as "stop" (multiprocessing's terminate()) stops it in the end.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def take(self) -> dict | None:
        """The notice once (then None): ``{"signal", "time", "deadline"}``, or None when none came."""
        notice, self._notice = self._notice, None
        return notice


def disk_iteration(path: str | None) -> int | None:
    """The iteration of a checkpoint directory ``.../iter_0000010`` (None: not one)."""
    import re

    found = re.search(r"iter_(\d+)/*$", path or "")
    return int(found.group(1)) if found else None


def train_rank(rank: int, world_size: int, job: JobConfig, *, local_rank: int | None = None,
               faults: tuple[Fault, ...] = ()) -> tuple[PlacementRecord, list[dict]]:
    """Train the whole job on this rank (torchrun); returns its placement record and its
    per-iteration metrics."""
    from workers.rank.distributed import rank_device

    local = rank if local_rank is None else local_rank
    runner = RankRunner(job, rank, world_size, device=rank_device(local), faults=faults)
    metrics = runner.run(job.training.train_iters)
    return runner.placement(local=local_rank), metrics


def forget_attempt(owner, held: list = ()) -> list:
    """Leave an attempt, keep the process: finish a pending checkpoint write of ``owner.runner``,
    leave torch.distributed (peers that are gone are not waited for), free the trainer and set
    ``owner.runner`` to None. A rank that survives a failed attempt does this before the next one (a
    Ray rank actor's ``reset``, a kept rank process). The process groups (torch's and ``held``)
    are freed on threads of their own, side by side
    (:func:`~workers.rank.distributed.release_in_background`: a gloo group's destructor waits for its
    connections to close, 30-70 ms a group in an 8-rank job), so the caller answers at once; returns
    those threads (on CUDA, join them before the next attempt's communicators)."""
    import gc

    import torch

    from workers.rank.timeline import Timeline

    timeline = getattr(owner, "timeline", None) or Timeline()
    runner, owner.runner = owner.runner, None
    with timeline.step("leave groups"):
        if runner is not None:
            try:
                runner.close()
            except Exception:  # noqa: BLE001 - a failed write leaves an incomplete checkpoint, never loaded
                pass
        # Held here (torch.distributed is left already), so freeing the trainer closes no connection yet.
        groups = leave_process_groups(held)
    with timeline.step("free trainer"):
        del runner
        gc.collect()  # what the trainer kept in reference cycles (the imports' objects are frozen)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return release_in_background(groups)


def torchrun_env() -> dict | None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK when started by torchrun, else None."""
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in needed):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "master_addr": os.environ["MASTER_ADDR"], "master_port": int(os.environ["MASTER_PORT"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0))}
