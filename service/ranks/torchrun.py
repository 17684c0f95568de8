"""One rank of a ``torchrun`` launch: ``torchrun --nproc-per-node N $(which raytron) run SPEC
--launcher processes``. torchrun owns the processes (and its own restarts, ``--max-restarts``),
so there is no controller here: each process trains its rank, and rank 0 returns the result.
"""

from __future__ import annotations

from service.control.errors import RankRaised
from service.control.result import result_object
from workers.config import JobConfig
from workers.rank.faults import Fault
from workers.grid import COORDS, ParallelGrid


def run_torchrun_rank(job: JobConfig, grid: ParallelGrid, env: dict, *, job_id: str,
                      faults: tuple[Fault, ...] = ()) -> dict | None:
    """Train this torchrun rank; the result object of ``raytron run`` (:func:`service.control.result.result_object`)
    on rank 0, None on the others."""
    import torch.distributed as dist

    from workers.rank.main import train_rank
    from workers.rank.distributed import init_distributed

    if env["world_size"] != grid.world_size:
        raise ValueError(f"torchrun started {env['world_size']} processes but the spec's world_size is "
                         f"{grid.world_size} (resources.num_nodes x gpus_per_node)")
    init_distributed(env["rank"], env["world_size"], env["master_addr"], env["master_port"],
                     timeout_s=job.collective_timeout_s)
    try:
        record, metrics = train_rank(env["rank"], env["world_size"], job, local_rank=env["local_rank"],
                                     faults=faults)
    except Exception as exc:  # noqa: BLE001 - torchrun reports the exit status; say which rank and why
        c = grid.coords(env["rank"])
        raise RankRaised(env["rank"], {k: c[k] for k in COORDS}, f"{type(exc).__name__}: {exc}") from exc
    records = [None] * env["world_size"]
    dist.all_gather_object(records, record)
    dist.destroy_process_group()
    if env["rank"] != 0:
        return None
    return result_object(job_id, "SUCCEEDED", grid, metrics, [r.to_dict() for r in records])
