"""Hot spares (``resources.spare_nodes``): idle rank actors on nodes of their own that take a lost node's ranks at a restart.

The Ray launcher's placement group holds ``num_nodes + spare_nodes`` bundles (one node each); the
job's nodes of the placement plan map to bundles through :attr:`Spares.slots` (at first node i is
bundle i), and each other bundle holds ``gpus_per_node`` spare actors: a
:class:`~workers.rank.actor.RankActor` started with no rank (torch and the trainer imported),
idle. At a restart with ranks kept in place, each plan node that lost a rank takes a spare bundle
whose actors are all up (:meth:`Spares.take`): its ranks start there as those actors
(``setup(..., as_rank=r)``), so the restart creates no actor. The whole node moves, so that its
tensor-parallel groups stay within one node; its ranks that survived become that bundle's spares
(their in-memory state dropped when one takes a rank). A bundle left short of actors (a rank
killed there, its node lost and its bundle moved by Ray to a free node) is filled in the
background after the next attempt's first call (:meth:`Spares.refill`), so that the torch
imports do not compete with the restore; Ray places a moved bundle when the cluster has room. A
failure while a refill is still starting waits for that bundle's actors (placed on a live node)
rather than starting new ones: they are further along.
"""

from __future__ import annotations

from typing import Callable

SPARE_START_WAIT_S = 60.0
"""How long a restart waits at most for a spare node whose actors are still starting (a torch import)."""


class Spares:
    """The spare actors of one job's placement group.

    Args:
        pg: the placement group (``num_nodes + spare_nodes`` bundles).
        num_nodes: the job's nodes (bundles ``0..num_nodes-1`` hold its ranks at first).
        gpus_per_node: actors per spare bundle (a whole node's ranks).
        make_actor: ``make_actor(pg, bundle) -> actor``: an idle rank actor in that bundle (it
            outlives the attempt that made the spares: nothing of that attempt but the job's settings).
    """

    def __init__(self, pg, num_nodes: int, spare_nodes: int, gpus_per_node: int, make_actor: Callable):
        self.pg, self.per_bundle, self._make = pg, gpus_per_node, make_actor
        self.slots = list(range(num_nodes))  # plan node -> bundle
        self.bundles: dict[int, list[tuple[object, object]]] = {}  # spare bundle -> [(actor, ready ref)]
        self._short: set[int] = set()  # spare bundles to fill at the next refill()
        for b in range(num_nodes, num_nodes + spare_nodes):
            self._fill(b)

    def _fill(self, bundle: int) -> None:
        have = self.bundles.setdefault(bundle, [])
        while len(have) < self.per_bundle:
            actor = self._make(self.pg, bundle)
            have.append((actor, actor.ping.remote()))

    def _usable(self, bundle: int, wait_s: float = 0.0) -> bool:
        """All of the bundle's actors are up (their start-up call returned, none died), waiting up
        to ``wait_s`` for those still starting."""
        import ray

        have = self.bundles.get(bundle, [])
        if len(have) < self.per_bundle:
            return False
        refs = [ref for _, ref in have]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        if len(ready) < len(refs):
            return False
        try:
            ray.get(refs, timeout=0)
            return True
        except Exception:  # noqa: BLE001 - one died (its node lost): not usable, filled again later
            self._drop_dead(bundle)
            return False

    def _placed(self) -> set[int]:
        """The bundles Ray has placed on a live node."""
        import ray
        from ray.util import placement_group_table

        try:
            nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - not knowable: none counted as placed
            return set()
        return {b for b, node in nodes.items() if node in alive}

    def _drop_dead(self, bundle: int) -> None:
        import ray

        alive = []
        for actor, ref in self.bundles.get(bundle, []):
            try:
                ray.get(ref, timeout=0)
                alive.append((actor, ref))
            except Exception:  # noqa: BLE001 - dead
                pass
        self.bundles[bundle] = alive
        self._short.add(bundle)

    def ready(self) -> int:
        """How many spare bundles have all their actors up (a node's ranks may move onto each)."""
        return sum(1 for b in list(self.bundles) if self._usable(b))

    def take(self, node: int, survivors: list, wait_s: float = 0.0) -> list | None:
        """A spare bundle's actors for plan node ``node`` (in slot order), or None when no spare
        bundle is up. With none up, a spare bundle placed on a live node whose actors are still
        starting (a refill) is waited for up to ``wait_s``: its actors are further along than new
        ones would be. ``node`` moves to that bundle; ``survivors`` (its ranks that survived, reset)
        become the spares of the bundle it leaves, which is filled up at the next :meth:`refill`."""
        old = self.slots[node]
        # The spares up longest first (a bundle a node just left comes last).
        others = [b for b in list(self.bundles) if b != old]
        spare = next((b for b in others if self._usable(b)), None)
        if spare is None and wait_s > 0:
            placed = self._placed()
            spare = next((b for b in others if b in placed and self._usable(b, wait_s)), None)
        if spare is None:
            return None
        actors = [a for a, _ in self.bundles.pop(spare)]
        self.slots[node] = spare
        self.bundles[old] = [(a, a.ping.remote()) for a in survivors]
        self._short.add(old)
        return actors

    def refill(self) -> None:
        """Start actors in the spare bundles left short (in the background: nothing waits for them;
        a moved bundle's start when Ray has placed it)."""
        short, self._short = self._short, set()
        for bundle in sorted(short):
            self._drop_dead(bundle)
            self._fill(bundle)
        self._short = set()

    def view(self) -> list[dict]:
        """Each spare bundle: its Ray node (None while Ray has not placed it), actors started and up."""
        import ray
        from ray.util import placement_group_table

        try:
            nodes = placement_group_table(self.pg).get("bundles_to_node_id", {})
        except Exception:  # noqa: BLE001 - only a view
            nodes = {}
        out = []
        for b in sorted(self.bundles):
            refs = [ref for _, ref in self.bundles[b]]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
            out.append({"bundle": b, "node_id": nodes.get(b), "actors": len(refs), "ready": len(ready)})
        return out

    def release(self) -> None:
        """Kill every spare actor (the placement group is removed by its owner)."""
        from service.ranks.ray_actors import kill_and_wait

        actors = [a for have in self.bundles.values() for a, _ in have]
        self.bundles = {}
        kill_and_wait(actors)


def spare_ranks(plan: list, kept: dict, spares: Spares | None, wait_s: float = 0.0) -> dict:
    """rank -> spare actor for the ranks of every plan node that lost a rank (``plan``: the
    attempt's :class:`~service.spec.placement.RankPlacement` list; ``kept``: rank -> actor kept in
    place, from which the moved nodes' survivors are removed; ``wait_s``: see :meth:`Spares.take`)."""
    if spares is None or not kept:
        return {}
    lost_nodes = sorted({p.node for p in plan if p.rank not in kept})
    taken: dict = {}
    for node in lost_nodes:
        ranks = sorted((p for p in plan if p.node == node), key=lambda p: p.local)
        actors = spares.take(node, [kept[p.rank] for p in ranks if p.rank in kept], wait_s)
        if actors is None:
            continue  # no spare up: new actors in the node's bundle, as without spares
        for p, actor in zip(ranks, actors):
            kept.pop(p.rank, None)
            taken[p.rank] = actor
    return taken


__all__ = ["SPARE_START_WAIT_S", "Spares", "spare_ranks"]
