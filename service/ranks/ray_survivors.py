"""Which ranks of a failed Ray attempt survive it, reset, to start the next attempt in place (:func:`survivors_of`)."""

from __future__ import annotations

import time

from service.ranks.ray_nodes import dead_nodes


def survivors_of(group) -> dict:
    """rank -> actor for the ranks whose last call ended (returned, or raised: the process
    lives) on a live node and that ``reset`` within ``reuse_wait_s``; empty when a node is lost
    or may be (Ray reports it dead, or a dead rank's raylet stopped answering).

    Each is reset as soon as its call ends: that frees its process groups, which makes peers
    still blocked in a collective with it fail now rather than at their timeout."""
    import ray
    from ray.exceptions import ActorUnavailableError, RayActorError

    if not group._ran and not group._setup_sent and group.job.memory_interval and group.pg is not None:
        return _untouched(group)
    if not group._ran or group.pg is None or len(group._inflight) != len(group.actors):
        return {}
    nodes = {p.node_id for p in group.placement}
    # A lost node: Ray moves its bundle to another node. Without in-memory state the attempt
    # starts over; with it (fault_tolerance.memory_interval) the ranks on the nodes left keep
    # their snapshots and the replicas they hold, and only the lost node's ranks are new.
    in_memory = bool(group.job.memory_interval)
    if nodes & dead_nodes() and not in_memory:
        return {}  # the placement group is being rescheduled: start over
    deadline = time.monotonic() + group.config.reuse_wait_s
    calls = dict(zip(group._inflight, range(len(group.actors))))  # ref -> rank
    resets: dict = {}
    kept = {}
    node_suspect = False
    while calls or resets:
        left = deadline - time.monotonic()
        if left <= 0:
            break  # still blocked (a hung or stopped rank, its peers): killed with the dead
        ready, _ = ray.wait([*calls, *resets], num_returns=1, timeout=left)
        for ref in ready:
            if ref in calls:
                rank = calls.pop(ref)
                try:
                    ray.get(ref, timeout=0)
                except ActorUnavailableError:
                    # Its raylet does not answer: the node may be lost before Ray says so
                    # (a health check away); its bundle must not be reused.
                    node_suspect = True
                    continue
                except RayActorError:
                    continue  # dead
                except Exception:  # noqa: BLE001 - it raised: the process lives on
                    pass
                resets[group.actors[rank].reset.remote()] = rank
            else:
                rank = resets.pop(ref)
                try:
                    ray.get(ref, timeout=0)
                    kept[rank] = group.actors[rank]
                except Exception:  # noqa: BLE001 - not reusable: killed with the dead
                    pass
    return {} if (node_suspect or nodes & dead_nodes()) and not in_memory else kept

def _untouched(group) -> dict:
    """With in-memory state, after an attempt that failed before its setup calls went out (a
    new rank cancelled while Ray moves a lost node's bundle): the ranks it kept are as the last
    attempt left them, reset and holding their snapshots and replicas; keep those that answer."""
    import ray

    if not group.reused:
        return {}
    refs = {group.actors[rank].reset.remote(): rank for rank in group.reused}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=group.config.reuse_wait_s)
    kept = {}
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
            kept[refs[ref]] = group.actors[refs[ref]]
        except Exception:  # noqa: BLE001 - gone: started again with the others
            pass
    return kept
