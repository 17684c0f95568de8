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

from dataclasses import dataclass
from datetime import timedelta

from workers.grid import DECODER_KINDS, ParallelGrid

# The kinds of group a rank belongs to, by attribute-style name: the decoder view's, the expert
# view's (its tp, dp are etp, expert_dp) and the embedding group (first and last pp stage).
DECODER_GROUPS = tuple(k.replace("-", "_") for k in DECODER_KINDS)
EXPERT_GROUPS = ("etp", "ep", "tp_ep", "tp_ep_pp", "expert_dp")
# Hierarchical CP (cp_comm_type a2a+p2p): inside each CP group, its a2a groups of consecutive CP ranks and
# the p2p rings across them (Megatron's hierarchical_context_parallel_groups).
HCP_GROUPS = ("hcp_a2a", "hcp_p2p")
GROUP_KINDS = DECODER_GROUPS + EXPERT_GROUPS + ("embedding",) + HCP_GROUPS
# Expert-view group kind (workers.grid.EXPERT_KINDS) -> its name here; its pp groups are the decoder's.
_EXPERT_NAMES = {"tp": "etp", "ep": "ep", "tp-ep": "tp_ep", "tp-ep-pp": "tp_ep_pp", "dp": "expert_dp"}


@dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """The groups one rank belongs to (Megatron-Core's ``ProcessGroupCollection``), one field
    per kind, plus their member lists.

    A handle is ``None`` for a group of one rank (and for every group of a world of one), and
    ``embedding_group`` is ``None`` on a rank outside the first and last pipeline stage.
    Frozen: a misspelt name is an error where it is written (``AttributeError`` on a read,
    ``FrozenInstanceError`` on an assignment).
    """

    grid: ParallelGrid
    rank: int
    # decoder view
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    cp_group: object = None
    dp_cp_group: object = None
    tp_pp_group: object = None
    tp_cp_group: object = None
    tp_dp_group: object = None
    tp_dp_cp_group: object = None
    # expert view
    etp_group: object = None
    ep_group: object = None
    tp_ep_group: object = None
    tp_ep_pp_group: object = None
    expert_dp_group: object = None
    # tied embeddings: first and last pipeline stage
    embedding_group: object = None
    # hierarchical CP: this rank's a2a group and p2p ring inside its CP group (None without a2a+p2p)
    hcp_a2a_group: object = None
    hcp_p2p_group: object = None
    members: dict[str, tuple[int, ...]]
    """kind (one of :data:`GROUP_KINDS`) -> global ranks of this rank's group of that kind, in
    group order; empty for ``embedding`` on a rank outside it. Read it with :meth:`ranks`."""

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of ``kind`` (one of :data:`GROUP_KINDS`, e.g. ``"dp_cp"``)."""
        return list(self.members[_known(kind)])

    def group(self, kind: str):
        """The handle of this rank's group of ``kind`` (one of :data:`GROUP_KINDS`)."""
        return getattr(self, f"{_known(kind)}_group")

    def handles(self) -> dict[str, object]:
        """kind -> handle, for every kind in :data:`GROUP_KINDS`."""
        return {kind: getattr(self, f"{kind}_group") for kind in GROUP_KINDS}


def _known(kind: str) -> str:
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown process-group kind {kind!r}; one of {', '.join(GROUP_KINDS)}")
    return kind


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


def hierarchical_cp_groups(cp_groups: list[list[int]], a2a: int) -> tuple[list[list[int]], list[list[int]]]:
    """Inside each CP group (global ranks in CP-rank order): its a2a groups, ``a2a`` consecutive CP ranks
    each, and its p2p rings, the CP ranks with the same place in their a2a group."""
    inner = [g[i:i + a2a] for g in cp_groups for i in range(0, len(g), a2a)]
    outer = [g[j::a2a] for g in cp_groups for j in range(a2a)]
    return inner, outer


def build_process_groups(grid: ParallelGrid, rank: int, *, backend: str | None = None,
                         timeout: timedelta | None = None, hierarchical_cp: tuple[int, ...] | None = None
                         ) -> ProcessGroups:
    """Create every group of ``grid`` (collectively) and return this rank's handles.

    Args:
        grid: the rank grid.
        rank: this rank.
        backend: default the world group's.
        timeout: every group's collective timeout; default the world group's (the job's
            ``fault_tolerance.collective_timeout_s``).
        hierarchical_cp: ``(a2a, p2p)`` sizes of hierarchical CP (``cp_comm_type: a2a+p2p``), or None.
    """
    from workers.parallel import comm

    plan: list[tuple[str, list[list[int]]]] = [(k.replace("-", "_"), grid.groups(k)) for k in DECODER_KINDS]
    plan += [(name, grid.groups(k, expert=True)) for k, name in _EXPERT_NAMES.items()]
    plan.append(("embedding", grid.embedding_groups()))
    if hierarchical_cp:
        plan += list(zip(HCP_GROUPS, hierarchical_cp_groups(grid.groups("cp"), hierarchical_cp[0])))
    single = grid.world_size == 1
    if not single:
        import torch.distributed as dist

        timeout = timeout or world_timeout()
    cache: dict[tuple[int, ...], object] = {}
    handles: dict[str, object] = {}
    members: dict[str, tuple[int, ...]] = {kind: () for kind in GROUP_KINDS}
    for name, groups in plan:
        for group in groups:
            key = tuple(group)
            if single or len(group) == 1:
                handle = None  # size-1 groups need no communicator
            elif key in cache:
                handle = cache[key]  # the same rank set under another name: reuse it
            else:
                handle = dist.new_group(list(group), backend=backend, timeout=timeout)
                cache[key] = handle
                # One communicator serves every kind with the same ranks; it keeps the first
                # (most specific) name, e.g. "tp" rather than "tp-ep-pp", in the byte counters.
                comm.label_group(handle, "cp" if name in HCP_GROUPS else name.replace("_", "-"))
            if rank in group:
                members[name], handles[f"{name}_group"] = key, handle
    return ProcessGroups(grid=grid, rank=rank, members=members, **handles)
