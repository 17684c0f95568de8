"""In-memory checkpoints replicated off-node (``fault_tolerance.memory_interval``, ``memory_replicas``): the peers, the exchange, the recovery.

Every ``memory_interval`` iterations each rank packs its complete state into host memory
(:mod:`workers.checkpoint.memory`) and sends a copy to each of its ``memory_replicas`` holders,
through a gloo group of its own with ``isend``/``irecv``: the transfer runs in gloo's threads while
the next iterations compute, and is waited for at the next snapshot. The holders are a pure
function of where the ranks run (:func:`replica_holders`): rank r's j-th replica goes to the rank
in r's slot on the j-th node after r's, so no node holds two copies of a rank's state. Where a
data-parallel twin of r (a rank holding the same params and, without the distributed optimizer,
the same moments, bit for bit) runs on another node, the copy sent is only the snapshot's prefix
(the meta and r's own pieces: ZeRO shards, buffers): the twin's own snapshot of the same iteration
is the off-node copy of the rest, and a restore joins the two.

A :class:`MemoryStore` outlives an attempt (a Ray rank actor keeps it across ``reset``): a rank's
own two newest snapshots and the two newest replicas it holds of each of its sources (the newest
may still be in flight when a failure strikes), and the metrics of the iterations it finished in
the call under way (the driver records a call's iterations when it returns, so those of a failed
call reach it only this way). At the next attempt every rank tells what it holds
(:meth:`Replicator.recover`), they agree on the newest iteration of which every rank's state is
held somewhere alive (:func:`plan_restore`) and whose metrics some live rank holds, the holders
send the replicas of the ranks that lost theirs (a replacement starts empty), and every rank
restores that iteration; the metrics of the iterations between the driver's last record and it
go back with the placement records, so the driver records them instead of a rank computing them
again. When some rank's
state is held nowhere, nothing is restored from memory and the rank falls back to the disk
checkpoint, with the reason.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from workers.checkpoint.memory import layout_key, pack, read_meta, restore, snapshot_sizes

SETTLE_S = 1.0  # after a failure: how long a replica still arriving from a live peer is waited for
KEEP = 2  # snapshots kept per rank: the newest (maybe still in flight) and the one before


def replica_holders(nodes: list, replicas: int) -> list[list[int]]:
    """``holders[r]``: the ranks that hold rank r's replicas, given each rank's node (any hashable).

    Nodes are ordered by their lowest rank; rank r, i-th of its node, sends its j-th replica
    (j = 1..replicas) to the (i mod size)-th rank of the j-th node after its own (cyclically). No
    holder shares r's node and the holders' nodes are distinct; with equal node sizes each rank
    holds exactly ``replicas`` replicas.
    """
    order = list(dict.fromkeys(nodes))
    if replicas >= len(order):
        raise ValueError(f"fault_tolerance.memory_replicas {replicas} needs more than {replicas} node(s); "
                         f"the job runs on {len(order)}: lower memory_replicas or add nodes")
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out = []
    for r, n in enumerate(nodes):
        i, k = members[n].index(r), order.index(n)
        out.append([members[m][i % len(members[m])] for m in (order[(k + j) % len(order)]
                                                               for j in range(1, replicas + 1))])
    return out


def plan_restore(inventories: list[dict], upto: int | None,
                 twins: list[list[int]] | None = None) -> tuple[int | None, dict[int, tuple | None], str]:
    """The newest iteration (<= ``upto``) of which every rank's state is held by a live rank.

    ``inventories[r]``: ``{"own": [iterations], "held": {source rank: [iterations]}, "prefixes":
    {source rank: [iterations]}}`` (``prefixes``: the held replicas that are only the snapshot's
    prefix, :mod:`workers.checkpoint.memory`). ``twins[r]``: the ranks whose shared pieces equal rank
    r's (its data-parallel twins): a prefix replica is complete with a twin's own copy of the same
    iteration. Returns ``(iteration, source, why)``: ``source[r]`` None when rank r restores its own
    copy, else ``(holder, twin)``: the lowest rank holding its replica and, for a prefix replica, the
    lowest twin with its own copy (else None); ``(None, {}, why)`` when no iteration is complete."""
    world = len(inventories)
    twins = twins or [[] for _ in range(world)]
    own = [{int(it) for it in inv.get("own", [])} for inv in inventories]
    held: list[dict[int, list[tuple[int, bool]]]] = [{} for _ in range(world)]  # rank -> iteration -> [(holder, prefix)]
    for h, inv in enumerate(inventories):  # holders in rank order
        prefixes = {int(src): {int(it) for it in its} for src, its in inv.get("prefixes", {}).items()}
        for src, its in inv.get("held", {}).items():
            for it in its:
                held[int(src)].setdefault(int(it), []).append((h, int(it) in prefixes.get(int(src), ())))

    def source(r: int, it: int) -> tuple[bool, tuple | None]:
        if it in own[r]:
            return True, None
        twin = next((t for t in sorted(twins[r]) if it in own[t]), None)
        usable = [(h, None) for h, prefix in held[r].get(it, []) if not prefix]  # a whole replica
        usable += [(h, twin) for h, prefix in held[r].get(it, []) if prefix and twin is not None]
        if not usable:
            return False, None
        return True, min(usable)  # the lowest holder (a whole replica first at the same holder)

    candidates = sorted({it for r in range(world) for it in own[r] | set(held[r]) if upto is None or it <= upto},
                        reverse=True)
    for it in candidates:
        found = [source(r, it) for r in range(world)]
        if all(ok for ok, _ in found):
            return it, {r: src for r, (_, src) in enumerate(found)}, ""
    if not candidates:
        return None, {}, ("no live rank holds an in-memory state: every copy was on the ranks or nodes lost "
                          "(a lost node takes every rank on it)")
    newest = candidates[0]
    lost = [r for r in range(world) if not source(r, newest)[0]]
    return None, {}, (f"both copies of rank(s) {lost}'s in-memory state are lost (its own and its replica's "
                      f"holder, or the data-parallel twins holding its params), and no older iteration is "
                      f"complete in memory")


class MemoryStore:
    """A rank's in-memory snapshots, kept across attempts: its own and the replicas it holds."""

    def __init__(self):
        self.key: dict | None = None
        self.own: dict[int, torch.Tensor] = {}
        self.held: dict[int, dict[int, torch.Tensor]] = {}
        self.pending: list = []  # (work, source or None, iteration, buffer) of the exchange in flight
        self.finished: dict[int, dict] = {}  # iteration -> metrics, of the call under way (or the one that failed)

    def adopt(self, key: dict) -> None:
        """Forget everything unless it was kept for this layout (``key``)."""
        if key != self.key:
            self.key, self.own, self.held, self.pending, self.finished = key, {}, {}, [], {}

    def inventory(self) -> dict:
        """What it holds, as :func:`plan_restore` reads it (a replica shorter than its meta's size is a prefix)."""
        return {"own": sorted(self.own), "held": {s: sorted(its) for s, its in self.held.items()},
                "prefixes": {s: sorted(it for it, b in its.items() if b.numel() < read_meta(b)["nbytes"])
                             for s, its in self.held.items()}}

    def settle(self, wait: bool) -> None:
        """Take the replicas whose receive finished (``wait``: wait for every one; else, as after a
        failure, only those that arrive within ``SETTLE_S``: a peer lost mid-transfer fails at once).
        (A gloo receive reports itself complete only once waited for, so it is waited for.)"""
        pending, self.pending = self.pending, []
        for i, (work, source, iteration, buf) in enumerate(pending):
            try:
                if wait:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=SETTLE_S))
            except Exception:  # noqa: BLE001 - a peer lost mid-transfer: that replica is not held
                if wait:
                    self.pending = pending[i + 1 :]  # the others may still arrive whole
                    raise
                continue
            if source is not None:
                _keep(self.held.setdefault(source, {}), iteration, buf)

    @property
    def nbytes(self) -> int:
        """Host bytes of every snapshot kept and every replica kept or being received."""
        return (sum(b.numel() for b in self.own.values()) + sum(b.numel() for its in self.held.values() for b in its.values())
                + sum(buf.numel() for _, source, _, buf in self.pending if source is not None))


def _keep(slots: dict, iteration: int, buf: torch.Tensor) -> None:
    slots[iteration] = buf
    for old in sorted(slots)[:-KEEP]:
        del slots[old]


def _spare(slots: dict, nbytes: int) -> torch.Tensor | None:
    """The oldest buffer of ``slots`` when it is about to be dropped (reused, not reallocated)."""
    if len(slots) < KEEP:
        return None
    buf = slots.pop(min(slots))
    return buf if buf.numel() == nbytes else None


class Replicator:
    """One attempt's snapshots and their exchange, over a gloo group of the job's ranks.

    Args:
        store: the rank's :class:`MemoryStore` (kept by whoever outlives the attempt).
        trainer: this rank's trainer (torch.distributed initialised, world size > 1).
        node: this rank's node (anything comparable; the holders are chosen from every rank's).
        replicas: ``fault_tolerance.memory_replicas``.
    """

    def __init__(self, store: MemoryStore, trainer, node, replicas: int):
        import torch.distributed as dist

        self.store, self.trainer, self.rank = store, trainer, trainer.rank
        world = trainer.grid.world_size
        self.group = dist.new_group(list(range(world)), backend="gloo")
        store.adopt(layout_key(trainer))
        store.settle(wait=False)  # after a failure: the replicas that arrived whole
        # One exchange tells every rank the others' nodes, state sizes and what they hold (recover()).
        told: list = [None] * world
        dist.all_gather_object(told, (node, snapshot_sizes(trainer), store.inventory(), store.finished))
        nodes = [t[0] for t in told]
        try:
            self.holders = replica_holders(nodes, replicas)
        except ValueError as e:  # an elastic job shrunk to too few nodes: no replicas this attempt
            self.holders, self.off = [[] for _ in nodes], str(e)
        else:
            self.off = ""
        self.sources = [s for s in range(world) if self.rank in self.holders[s]]
        self.sizes = [t[1]["nbytes"] for t in told]
        self.prefixes = [t[1]["prefix"] for t in told]
        # data-parallel twins (the same shared pieces); one on another node holds r's shared bytes
        # off-node already, so r's replicas are the prefix of its snapshot alone
        self.twins = [[t for t in range(world) if t != r and told[t][1]["shared"] == told[r][1]["shared"]]
                      for r in range(world)]
        self.replica_sizes = [self.prefixes[r] if any(nodes[t] != nodes[r] for t in self.twins[r]) else self.sizes[r]
                              for r in range(world)]
        self.inventories = [t[2] for t in told]
        self.finished: dict[int, dict] = {}  # the metrics of the failed call's iterations, the lowest live rank's
        for t in told:
            for it, metrics in t[3].items():
                self.finished.setdefault(int(it), metrics)
        self.bytes_sent = self.replica_sizes[self.rank] * len(self.holders[self.rank])

    def snapshot(self) -> dict:
        """Pack this iteration's state and start sending it to the holders; returns its figures."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        store = self.store
        store.settle(wait=True)  # the previous exchange (its buffers are reused below)
        it = self.trainer.iteration
        buf = pack(self.trainer, _spare(store.own, self.sizes[self.rank]))
        _keep(store.own, it, buf)
        sent = buf.narrow(0, 0, self.replica_sizes[self.rank])
        for h in self.holders[self.rank]:
            store.pending.append((dist.isend(sent, h, group=self.group), None, it, buf))
        for s in self.sources:
            into = _spare(store.held.setdefault(s, {}), self.replica_sizes[s])
            into = torch.empty(self.replica_sizes[s], dtype=torch.uint8) if into is None else into
            store.pending.append((dist.irecv(into, s, group=self.group), s, it, into))
        return {"memory_snapshot_s": round(time.perf_counter() - t0, 4), "memory_bytes_sent": self.bytes_sent,
                "memory_host_bytes": store.nbytes}

    def recover(self, upto: int | None) -> dict:
        """Agree on the newest iteration complete in memory and restore it (collective): at most
        ``upto`` (the iterations the driver recorded) and the iterations after it whose metrics a
        live rank holds (a failed call's, which the driver never got).

        Returns ``{"iteration", "source", "from_replicas", "caught_up"}`` (``source``: "own" or
        "replica from rank H"; ``caught_up``: the metrics of iterations ``upto + 1 ..`` the restored
        one), or ``{"iteration": None, "why"}`` when the state is not complete in memory."""
        import torch.distributed as dist

        store, world = self.store, len(self.sizes)
        reach = upto
        while reach is not None and reach + 1 in self.finished:
            reach += 1
        iteration, source, why = plan_restore(self.inventories, reach, self.twins)  # gathered at the attempt's start
        if iteration is None:
            return {"iteration": None, "why": why}
        if iteration == 0:
            return {"iteration": None, "why": "nothing to restore"}
        for r in range(world):  # the same order on every rank: each pair meets in turn
            if source[r] is None:
                continue
            (h, twin), buf = source[r], None
            if self.rank == r:
                buf = torch.empty(self.sizes[r], dtype=torch.uint8)
            replica = store.held[r][iteration] if self.rank == h else None
            n = self.sizes[r] if twin is None else self.prefixes[r]
            self._move(h, r, replica, None if buf is None else buf.narrow(0, 0, n))
            if twin is not None:  # the shared bytes from the twin's own copy of the iteration
                mine = store.own[iteration] if self.rank == twin else None
                self._move(twin, r, None if mine is None else mine[self.prefixes[twin]:],
                           None if buf is None else buf[self.prefixes[r]:])
            if buf is not None:
                _keep(store.own, iteration, buf)
        buf = store.own[iteration]
        if read_meta(buf)["iteration"] != iteration:
            raise ValueError(f"rank {self.rank}: the snapshot kept as iteration {iteration} is not that iteration's")
        for slots in (store.own, *store.held.values(), store.finished):
            for newer in [it for it in slots if it > iteration]:
                del slots[newer]  # past what the job goes on from
        restore(self.trainer, buf)
        mine = source[self.rank]
        how = "own" if mine is None else f"replica from rank {mine[0]}" + (
            "" if mine[1] is None else f", params from its data-parallel twin rank {mine[1]}")
        return {"iteration": iteration, "source": how,
                "from_replicas": sorted(r for r, h in source.items() if h is not None),
                "caught_up": [self.finished[it] for it in range(iteration + 1 if upto is None else upto + 1, iteration + 1)]}


    def _move(self, src: int, dst: int, data: torch.Tensor | None, into: torch.Tensor | None) -> None:
        """One transfer of the restore: ``src`` sends ``data``, ``dst`` receives ``into`` (others: nothing)."""
        import torch.distributed as dist

        if self.rank == src:
            dist.send(data, dst, group=self.group)
        elif self.rank == dst:
            dist.recv(into, src, group=self.group)


__all__ = ["KEEP", "MemoryStore", "Replicator", "plan_restore", "replica_holders"]
