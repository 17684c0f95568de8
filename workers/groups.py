"""Materialise and cache the torch.distributed groups of a :class:`ParallelGrid`.

Every rank must create every group, in the same order (torch.distributed's rule); each
rank keeps the handle of the groups it belongs to. Groups are created once per job
(Megatron-Core's ``HyperCommGrid`` rule) and labelled for the communication counters.
A single-process run (world size 1) creates nothing: every handle is ``None``, which the
layers treat as "no parallelism".

Every group gets the job's collective timeout (by default the one the world group was
initialised with), not torch's 30-minute default: the timeout is what turns a silent peer
into an error, and a hang inside a TP or PP group must be caught as soon as one in the world
group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from workers.grid import DECODER_KINDS, EXPERT_KINDS, ParallelGrid


@dataclass
class ProcessGroups:
    """The groups one rank belongs to, plus their member lists (global ranks, group order).

    Attributes are named by kind: ``tp``, ``pp``, ``dp``, ``cp``, ``dp_cp``, ``tp_pp``,
    ``tp_cp``, ``tp_dp``, ``tp_dp_cp`` (decoder view), ``etp``, ``ep``, ``tp_ep``,
    ``tp_ep_pp``, ``expert_dp`` (expert view) and ``embedding``.
    """

    grid: ParallelGrid
    rank: int
    handles: dict[str, object] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)

    def __getattr__(self, name: str):
        handles = self.__dict__.get("handles", {})
        if name in handles:
            return handles[name]
        raise AttributeError(name)

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind`` (attribute-style name, e.g. ``dp_cp``)."""
        return self.members[kind]


_EXPERT_NAMES = {"tp": "etp", "ep": "ep", "tp-ep": "tp_ep", "tp-ep-pp": "tp_ep_pp", "dp": "expert_dp", "pp": None}


def world_timeout() -> timedelta | None:
    """The collective timeout the default (world) group was initialised with, or None if unknown."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    try:  # no public getter in torch 2.13; the backend's options carry it
        return dist.group.WORLD._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001
        return None


def build_process_groups(grid: ParallelGrid, rank: int, *, backend: str | None = None,
                         timeout: timedelta | None = None) -> ProcessGroups:
    """Create every group of ``grid`` (collectively) and return this rank's handles.

    Args:
        grid: the rank grid.
        rank: this rank.
        backend: default the world group's.
        timeout: every group's collective timeout; default the world group's (the job's
            ``fault_tolerance.collective_timeout_s``).
    """
    from workers.parallel import comm

    pg = ProcessGroups(grid=grid, rank=rank)
    plan: list[tuple[str, list[list[int]]]] = [(k.replace("-", "_"), grid.groups(k)) for k in DECODER_KINDS]
    plan += [(name, grid.groups(k, expert=True)) for k, name in _EXPERT_NAMES.items() if name]
    plan.append(("embedding", grid.embedding_groups()))
    single = grid.world_size == 1
    if not single:
        import torch.distributed as dist

        timeout = timeout or world_timeout()
    cache: dict[tuple[int, ...], object] = {}
    for name, groups in plan:
        for members in groups:
            key = tuple(members)
            if rank in members:
                pg.members[name] = list(members)
            if single or len(members) == 1:
                handle = None  # size-1 groups need no communicator
            elif key in cache:
                handle = cache[key]  # the same rank set under another name: reuse it
            else:
                handle = dist.new_group(list(members), backend=backend, timeout=timeout)
                cache[key] = handle
                # One communicator serves every kind with the same ranks; it keeps the first
                # (most specific) name, e.g. "tp" rather than "tp-ep-pp", in the byte counters.
                comm.label_group(handle, name.replace("_", "-"))
            if rank in members:
                pg.handles[name] = handle
    return pg
