"""What one rank runs, whoever started it: a local rank process, a Ray actor, or torchrun.

:class:`RankRunner` wraps the :class:`~workers.train.Trainer` (the seam to the training code):
it runs iterations, fires failure drills (:mod:`workers.faults`) at the right iteration, and
when anything raises it tears down this rank's process groups at once, so that peers blocked
in a collective with it see "connection closed" now instead of waiting for their timeout.
:func:`torchrun_env` reads the standard torchrun variables so that ``torchrun
--nproc-per-node N $(which raytron) run SPEC --launcher processes`` runs the same code.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

from workers.config import JobConfig
from workers.faults import Fault, trigger

COORDS = ("tp", "pp", "dp", "cp", "ep")


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
                 on_stall: Callable[[str], None] | None = None):
        from workers.train import Trainer

        self.rank = rank
        self.faults = {f.iteration: f for f in faults if f.rank == rank}
        self.on_stall = on_stall
        self.trainer = Trainer(job, rank, world_size, device=device)

    def info(self) -> dict:
        """Where this rank runs and its grid coordinates (its placement record)."""
        c = self.trainer.coords
        return {"rank": self.rank, "node_id": socket.gethostname(), "pid": os.getpid(),
                "device": str(self.trainer.device), **{k: c[k] for k in (*COORDS, "etp", "expert_dp")}}

    def run(self, iterations: int, on_metrics: Callable[[dict], None] | None = None) -> list[dict]:
        """``iterations`` iterations; returns their metrics. On any error the groups are torn down."""
        out = []
        try:
            for _ in range(iterations):
                fault = self.faults.pop(self.trainer.iteration + 1, None)
                if fault is not None:
                    trigger(fault, self.on_stall)
                metrics = self.trainer.train_step()
                if on_metrics is not None:
                    on_metrics(metrics)
                out.append(metrics)
        except BaseException:
            abort_process_groups()
            raise
        return out


def abort_process_groups() -> None:
    """Leave torch.distributed now (closes this rank's connections; peers fail fast)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort on a rank that is failing anyway
        pass


def train_rank(rank: int, world_size: int, job: JobConfig, *, local_rank: int | None = None,
               faults: tuple[Fault, ...] = ()) -> dict:
    """Train the whole job on this rank (torchrun); returns its placement record plus its losses."""
    from workers.spawn import rank_device

    runner = RankRunner(job, rank, world_size, device=rank_device(rank if local_rank is None else local_rank),
                        faults=faults)
    metrics = runner.run(job.training.train_iters)
    return {**runner.info(), "metrics": metrics}


def torchrun_env() -> dict | None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK when started by torchrun, else None."""
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in needed):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "master_addr": os.environ["MASTER_ADDR"], "master_port": int(os.environ["MASTER_PORT"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0))}
