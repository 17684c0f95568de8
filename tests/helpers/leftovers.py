"""What a Ray test leaves behind: the processes and sessions to find after a cluster is gone."""

from __future__ import annotations


def leftovers() -> tuple[list, list]:
    """raytron actors still alive and raytron placement groups not removed."""
    from ray.util.placement_group import placement_group_table
    from ray.util.state import list_actors

    actors = [a.name for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
              if (a.name or "").startswith("raytron:")]
    groups = [g["name"] for g in placement_group_table().values()
              if g["name"].startswith("raytron:") and g["state"] != "REMOVED"]
    return actors, groups
