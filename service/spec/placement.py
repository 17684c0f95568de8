"""Placement plan: rank -> (node, local slot), with every tensor-parallel group inside one node.

Pure integer math over a :class:`~workers.grid.ParallelGrid`. TP (and expert-TP) groups
exchange activations in every layer, so they must never cross a node; CP and EP groups
are the next-chattiest, so they are kept inside a node too when they fit.

The plan is built from *atoms*: the connected components of the TP and expert-TP groups
(union-find). Atoms are then merged along CP groups, then EP groups, while a merged
component still fits a node. Components are packed into nodes first-fit in order of
their lowest rank, and the ranks of one node get consecutive local slots in rank order.
For the default order (tp innermost) this is simply ``node = rank // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.grid import ParallelGrid


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int
    local: int


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))
        self.size = [1] * n

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            if ra > rb:
                ra, rb = rb, ra
            self.parent[rb] = ra
            self.size[ra] += self.size[rb]


def _components(uf: _UnionFind, n: int) -> dict[int, list[int]]:
    comps: dict[int, list[int]] = {}
    for r in range(n):
        comps.setdefault(uf.find(r), []).append(r)
    return comps


def _try_merge(uf: _UnionFind, groups: list[list[int]], n: int, capacity: int) -> _UnionFind:
    """Merge components along ``groups`` if every resulting component fits ``capacity``
    and divides it evenly (so nodes pack without holes); otherwise leave them as they were."""
    trial = _UnionFind(n)
    trial.parent = list(uf.parent)
    trial.size = list(uf.size)
    for g in groups:
        for r in g[1:]:
            trial.union(g[0], r)
    sizes = {trial.size[trial.find(r)] for r in range(n)}
    if all(s <= capacity and capacity % s == 0 for s in sizes):
        return trial
    return uf


def plan_placement(grid: ParallelGrid, gpus_per_node: int, num_nodes: int | None = None) -> list[RankPlacement]:
    """Assign every rank a node and a local slot.

    Args:
        grid: the job's rank grid.
        gpus_per_node: slots per node.
        num_nodes: nodes available; default ``ceil(world_size / gpus_per_node)``.

    Returns:
        One :class:`RankPlacement` per rank, in rank order.

    Raises:
        ValueError: TP (or expert TP) larger than a node, or the world does not fit.
    """
    n = grid.world_size
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    if num_nodes is None:
        num_nodes = -(-n // gpus_per_node)
    for name, size in (("tensor_model_parallel_size", grid.tp), ("expert_tensor_parallel_size", grid.etp)):
        if size > gpus_per_node:
            raise ValueError(
                f"{name} {size} is larger than gpus_per_node {gpus_per_node}: a tensor-parallel "
                f"group must fit inside one node; use {name} <= {gpus_per_node} or bigger nodes"
            )
    if n > num_nodes * gpus_per_node:
        raise ValueError(
            f"world_size {n} does not fit {num_nodes} node(s) x {gpus_per_node} GPUs = "
            f"{num_nodes * gpus_per_node} slots; add nodes or lower the world size"
        )
    uf = _UnionFind(n)
    for g in grid.groups("tp") + grid.groups("tp", expert=True):
        for r in g[1:]:
            uf.union(g[0], r)
    atom = max(uf.size[uf.find(r)] for r in range(n))
    if atom > gpus_per_node:
        raise ValueError(
            f"the dense TP groups (tp {grid.tp}) and expert TP groups (etp {grid.etp}) interlock "
            f"into blocks of {atom} ranks, more than gpus_per_node {gpus_per_node}; "
            f"use etp equal to tp or a smaller one, or bigger nodes"
        )
    # Optional co-location: CP, then EP (then both together through the union).
    for groups in (grid.groups("cp"), grid.groups("ep", expert=True)):
        uf = _try_merge(uf, groups, n, gpus_per_node)

    comps = sorted(_components(uf, n).values(), key=lambda c: c[0])
    free = [gpus_per_node] * num_nodes
    members: list[list[int]] = [[] for _ in range(num_nodes)]
    for comp in comps:
        for node in range(num_nodes):
            if free[node] >= len(comp):
                free[node] -= len(comp)
                members[node].extend(comp)
                break
        else:
            raise ValueError(
                f"cannot pack blocks of {len(comp)} ranks that must share a node into "
                f"{num_nodes} node(s) x {gpus_per_node} GPUs; choose gpus_per_node divisible by {len(comp)}"
            )
    out: list[RankPlacement | None] = [None] * n
    for node, ranks in enumerate(members):
        for local, r in enumerate(sorted(ranks)):
            out[r] = RankPlacement(rank=r, node=node, local=local)
    return out  # type: ignore[return-value]


def check_tp_in_node(grid: ParallelGrid, node_of_rank: dict[int, object] | list) -> list[list[int]]:
    """The TP and expert-TP groups that span more than one node (empty when the plan is right).

    ``node_of_rank`` maps rank -> any node identifier (a plan's node index, or a Ray node id
    as the actors report it).
    """
    bad = []
    for g in grid.groups("tp") + grid.groups("tp", expert=True):
        if len({node_of_rank[r] for r in g}) > 1:
            bad.append(g)
    return bad
