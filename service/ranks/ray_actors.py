"""A job's Ray rank actors: their Ray class (made once per process), and their end with the
placement group's: killed and known dead, what an earlier runner of
the job left behind (:func:`clear_leftovers`), and the ranks kept between attempts (:class:`WarmRanks`)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass


@functools.cache
def rank_actor_class():
    """The rank actor as a Ray actor class, made once per process: Ray exports a class each time
    ``ray.remote`` wraps it (about 0.15 s of this process's CPU, most of it hashing the class's
    bytecode), and exports it again by itself in a new cluster or job."""
    import ray

    from workers.rank.actor import RankActor

    return ray.remote(RankActor)


def kill_actors(actors: list) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead is fine
            pass


def kill_and_wait(actors: list) -> None:
    """Kill ``actors`` and wait until the GCS knows they are dead (a call on a killed actor fails
    then): after it their names are free and none shows as alive in ``ray list actors``."""
    import ray

    kill_actors(actors)
    if actors:
        ray.wait([a.ping.remote() for a in actors], num_returns=len(actors), timeout=30)


def clear_leftovers(job_id: str, world_size: int, wait_s: float = 30.0) -> None:
    """Remove the placement group and rank actors an earlier runner of ``job_id`` left behind.

    A runner whose driver died (its raylet killed, its process SIGKILLed) owns its named placement
    group and actors until the GCS marks that driver dead, which may come after the next runner
    of the job starts; creating them again under the same names then fails ("already exists").
    Within one runner an attempt always frees both before the next one is placed, and the
    scheduler runs one runner per job, so whatever exists under these names here is stale."""
    import ray
    from ray.util import placement_group_table
    from ray.util.placement_group import get_placement_group, remove_placement_group

    from workers.rank.actor import actor_name

    stale = []
    for rank in range(world_size):
        try:
            stale.append(ray.get_actor(actor_name(job_id, rank)))
        except ValueError:
            pass
    kill_and_wait(stale)
    try:
        pg = get_placement_group(f"raytron:{job_id}")
    except ValueError:
        return
    remove_placement_group(pg)
    deadline = time.monotonic() + wait_s
    while placement_group_table(pg).get("state") not in ("REMOVED", None) and time.monotonic() < deadline:
        time.sleep(0.1)


@dataclass
class WarmRanks:
    """The ranks that survived a failed attempt, reset, with the attempt's placement group and hot
    spares: what the next attempt of the same shape (``key``) starts on instead of new actors."""

    key: tuple
    pg: object
    actors: dict  # rank -> actor handle
    spares: object = None  # service.ranks.spares.Spares, or None

    def release(self) -> None:
        """Kill the actors and the spares, remove the placement group."""
        from ray.util.placement_group import remove_placement_group

        kill_and_wait(list(self.actors.values()))
        self.actors = {}
        if self.spares is not None:
            self.spares.release()
            self.spares = None
        remove_placement_group(self.pg)


def error_summary(exc: BaseException) -> str:
    """First line of a Ray error, plus its last line when that is the underlying exception."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return lines[0] if len(lines) == 1 or lines[-1] in lines[0] else f"{lines[0]} ... {lines[-1]}"
