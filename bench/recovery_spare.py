"""The "memory+spare" path of ``bench/recovery_bench.py``: kill -9 of a rank, again and again, in one job with in-memory checkpoints and a hot spare node.

The job of the benchmark (8 ranks, tp 2 x dp 4 on 4 nodes of 2 slots) with
``fault_tolerance.memory_interval: 1`` and ``resources.spare_nodes: 1`` runs on the benchmark's
cluster (one node more than the job's). Rank 3 is killed with SIGKILL after iteration 3 and then
again each time the spare taken has been replaced (``gap_s`` after the last recovery), ``kills``
times. Per kill, from the job's own events: *detection* (kill -> failure event: the survivors'
calls ended and reset, the dead rank known), *replacement* (failure -> ranks placed, minus the
restore: the new attempt's STARTING, the spares taking the lost node's ranks, the process group
and trainers built again), *restore* (the slowest rank's agreement and restore from memory),
*first iteration* (placed -> the next iteration finished).
"""

from __future__ import annotations

import os
import signal
import time


def child_spare(spec: dict, kills: int = 5, gap_s: float = 8.0) -> dict:
    from service.control.events import JobState
    from service.control.jobs import start_job
    from service.ranks.ray_cluster import ray_session
    from service.ranks.ray_launcher import RayLauncher
    from service.spec.spec import parse_spec, to_job_config

    spec = {**spec, "resources": {**spec["resources"], "spare_nodes": 1},
            "training": {**spec["training"], "train_iters": 3 + kills * 60},
            "fault_tolerance": {**spec["fault_tolerance"], "memory_interval": 1, "max_restarts": kills}}
    job = to_job_config(parse_spec(spec))
    rounds: list[dict] = []
    placements: list = []
    state = {"recovered": 0.0}

    def on_event(e) -> None:
        cur = rounds[-1] if rounds else None
        if e.kind == "placement":
            placements.append(e.data["placement"])
            if cur is not None and "placed" not in cur:
                cur["placed"] = e.time
                cur["load"] = max(p.get("load_s") or 0.0 for p in e.data["placement"])
                cur["spare_ranks"] = [p["rank"] for p in e.data["placement"] if p.get("spare")]
        elif e.kind == "iteration":
            if cur is not None and "placed" in cur and "next" not in cur:
                cur["next"] = e.time
                state["recovered"] = e.time
            due = e.data["iteration"] >= 3 and (cur is None or ("next" in cur and e.time - state["recovered"] >= gap_s))
            if due and len(rounds) < kills:
                pid = next(p["pid"] for p in placements[-1] if p["rank"] == 3)
                rounds.append({"kill": time.time(), "iteration": e.data["iteration"]})
                os.kill(pid, signal.SIGKILL)
        elif e.kind == "failure" and cur is not None and "failure" not in cur:
            cur["failure"] = e.time
        elif e.kind == "restore" and cur is not None:
            cur["restored"] = e.data.get("iteration")
            cur["source"] = e.data.get("source")
        elif e.kind == "state" and e.state is JobState.STARTING and cur is not None and "starting" not in cur:
            cur["starting"] = e.time

    with ray_session() as session:
        result = start_job(job, launcher=RayLauncher(session), on_event=on_event).wait()
    splits = [{"detection_s": r["failure"] - r["kill"], "replacement_s": r["placed"] - r["failure"] - r["load"],
               "restore_s": r["load"], "first_iteration_s": r["next"] - r["placed"], "total_s": r["next"] - r["kill"],
               "iterations_lost": r["iteration"] - r.get("restored", 0), "source": r.get("source"),
               "spare_ranks": r.get("spare_ranks")}
              for r in rounds if "next" in r]
    return {"state": result["state"], "restarts": result["restarts"], "error": result.get("error"), "kills": splits}


def median_split(kills: list[dict]) -> dict:
    """The median of each figure over the kills (and the totals, each)."""
    out = {}
    for key in ("detection_s", "replacement_s", "restore_s", "first_iteration_s", "total_s"):
        values = sorted(k[key] for k in kills)
        out[key] = values[len(values) // 2] if values else float("nan")
    out["totals"] = [round(k["total_s"], 3) for k in kills]
    out["iterations_lost"] = [k["iterations_lost"] for k in kills]
    out["spare_taken"] = sum(1 for k in kills if k["spare_ranks"])
    return out


__all__ = ["child_spare", "median_split"]
