"""What one rank runs, whoever started it: the local process launcher, torchrun, or a Ray actor.

:func:`train_rank` builds the :class:`~workers.train.Trainer` and runs iterations, reporting
each iteration's metrics through an optional callback. :func:`torchrun_env` reads the
standard torchrun variables so that ``torchrun --nproc-per-node N $(which raytron) run
SPEC --launcher processes`` runs the same code, one rank per torchrun process.
"""

from __future__ import annotations

import os
import socket
from typing import Callable

from workers.config import JobConfig


def rank_info(trainer) -> dict:
    """How the rank reports itself in the placement table."""
    c = trainer.coords
    return {"rank": trainer.rank, "node_id": socket.gethostname(), "pid": os.getpid(),
            "device": str(trainer.device), "tp": c["tp"], "pp": c["pp"], "dp": c["dp"], "cp": c["cp"], "ep": c["ep"]}


def train_rank(rank: int, world_size: int, job: JobConfig, iterations: int | None = None,
               report: Callable[[dict], None] | None = None, local_rank: int | None = None) -> dict:
    """Train ``iterations`` (default: the job's train_iters) on this rank; returns its record."""
    from workers.spawn import rank_device
    from workers.train import Trainer

    device = rank_device(rank if local_rank is None else local_rank)
    trainer = Trainer(job, rank, world_size, device=device)
    info = rank_info(trainer)
    if report is not None and rank == 0:
        report({"event": "ready", "rank": info})
    losses = []
    metrics = {}
    for _ in range(job.training.train_iters if iterations is None else iterations):
        metrics = trainer.train_step()
        losses.append(metrics["loss"])
        if report is not None and rank == 0:
            report({"event": "iteration", **metrics})
    return {**info, "losses": losses, "last_metrics": metrics}


def torchrun_env() -> dict | None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK when started by torchrun, else None."""
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in needed):
        return None
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
            "master_addr": os.environ["MASTER_ADDR"], "master_port": int(os.environ["MASTER_PORT"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0))}
