"""The raytron paths of ``bench/recovery_bench.py``: one job, rank 3 killed with SIGKILL again and again, each recovery split into detection, replacement, restore and first iteration.

The benchmark's job (8 ranks, tp 2 x dp 4 on 4 nodes of 2 slots, 40 iterations, a disk
checkpoint every 20) in one of three modes: ``spare`` (``fault_tolerance.memory_interval: 1`` and
``resources.spare_nodes: 1``), ``memory`` (memory_interval 1, no spare) and ``disk`` (neither: the
newest disk checkpoint). Rank 3 is killed ``kills`` times, each 50 ms into the call after an
iteration (mid-iteration, as a real failure strikes), the first after iteration 3, each next one
``gap`` iterations after the last recovery; in the ``spare`` mode only once the spare node's actors
are all up again (the driver waits before the kill, so every kill measures a recovery onto a
started spare). Per kill, from the job's own events: *detection* (kill -> failure event: the death
known to the driver, the survivors' calls ended and reset, the dead ranks' actors gone),
*replacement* (failure -> ranks placed, minus the restore: the new attempt's STARTING, the spares
or new actors taking the lost node's ranks, the process group and trainers built again),
*restore* (the slowest rank's restore: from memory, or its disk checkpoint load) and *first
iteration* (placed -> the next iteration finished); iterations lost (recorded before the kill,
minus the iteration restored). *Detection* is profiled further from the driver's side: the death
known (the call's error out of the launcher's collect), the survivors reset
(:func:`~service.ranks.ray_survivors.survivors_of`), the dead actors known dead (``kill_and_wait``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

ITERS, SAVE_EVERY = 40, 20


def _profile() -> list:
    """Wrap the launcher's steps of a failed attempt's teardown so that each records when it ended."""
    import service.ranks.ray_launcher as rl

    marks: list = []

    def timed(name, fn, on_error_only=False):
        def wrapper(*args, **kwargs):
            try:
                out = fn(*args, **kwargs)
            except BaseException:
                marks.append((name, time.time()))
                raise
            if not on_error_only:
                marks.append((name, time.time()))
            return out
        return wrapper

    rl.RayRankGroup._collect = timed("death_known", rl.RayRankGroup._collect, on_error_only=True)
    rl.survivors_of = timed("survivors_reset", rl.survivors_of)
    rl.kill_and_wait = timed("dead_gone", rl.kill_and_wait)
    return marks


def child_kills(spec: dict, mode: str, ckpt_dir: str, kills: int = 5, gap: int = 4) -> dict:
    from service.control.events import JobState
    from service.control.jobs import start_job
    from service.ranks.ray_cluster import ray_session
    from service.ranks.ray_launcher import RayLauncher
    from service.spec.spec import parse_spec, to_job_config

    memory = 1 if mode in ("spare", "memory") else 0
    spec = {**spec, "resources": {**spec["resources"], "spare_nodes": 1 if mode == "spare" else 0},
            "training": {**spec["training"], "train_iters": ITERS},
            "checkpoint": {"save_interval": SAVE_EVERY, "dir": ckpt_dir},
            "fault_tolerance": {**spec["fault_tolerance"], "memory_interval": memory, "max_restarts": kills}}
    job = to_job_config(parse_spec(spec))
    marks = _profile()
    groups: list = []
    rounds: list[dict] = []
    placements: list = []
    state = {"since": 0}  # iterations recorded since the last recovery

    def spare_up(timeout_s: float = 60.0) -> None:
        spares = getattr(groups[-1], "spares", None) if groups else None
        deadline = time.monotonic() + timeout_s
        while spares is not None and not spares.ready() and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(pid: int, round_: dict) -> None:
        time.sleep(0.05)
        round_["iteration"], round_["kill"] = state["last"], time.time()
        os.kill(pid, signal.SIGKILL)

    def on_event(e) -> None:
        cur = rounds[-1] if rounds else None
        if e.kind == "placement":
            placements.append(e.data["placement"])
            if cur is not None and "placed" not in cur:
                cur["placed"] = e.time
                cur["load"] = max(p.get("load_s") or 0.0 for p in e.data["placement"])
                cur["spare_ranks"] = [p["rank"] for p in e.data["placement"] if p.get("spare")]
                cur["restored"] = int(e.data["placement"][0].get("resumed_iteration") or 0)
        elif e.kind == "iteration":
            state["last"], state["since"] = e.data["iteration"], state["since"] + 1
            if cur is not None and "placed" in cur and "next" not in cur:
                cur["next"], state["since"] = e.time, 0
            first = cur is None and e.data["iteration"] >= 3
            due = first or (cur is not None and "next" in cur and state["since"] >= gap)
            if due and len(rounds) < kills and e.data["iteration"] < ITERS - 1:
                if mode == "spare":
                    spare_up()
                pid = next(p["pid"] for p in placements[-1] if p["rank"] == 3)
                rounds.append({})  # now, so that the next event of this call does not kill again
                threading.Thread(target=kill, args=(pid, rounds[-1]), daemon=True).start()
        elif e.kind == "failure" and cur is not None and "failure" not in cur:
            cur["failure"] = e.time
        elif e.kind == "restore" and cur is not None:
            cur["restored"] = e.data.get("iteration")
            cur["source"] = e.data.get("source")
        elif e.kind == "state" and e.state is JobState.STARTING and cur is not None and "starting" not in cur:
            cur["starting"] = e.time

    with ray_session() as session:
        launcher = RayLauncher(session)
        # One iteration per call in every mode (memory_interval 1 asks for that anyway): the disk
        # path's first iteration is then known when it ends, not at the end of a second-long call.
        launcher.config = replace(launcher.config, call_target_s=0.0)
        make = launcher.make_group
        launcher.make_group = lambda *a, **k: groups.append(make(*a, **k)) or groups[-1]
        result = start_job(job, launcher=launcher, on_event=on_event).wait()
    splits = []
    for r in rounds:
        if "next" not in r:
            continue
        after = {}
        for name, t in marks:
            if r["kill"] <= t <= r["failure"] and name not in after:
                after[name] = t - r["kill"]
        splits.append({"detection_s": r["failure"] - r["kill"], "replacement_s": r["placed"] - r["failure"] - r["load"],
                       "restore_s": r["load"], "first_iteration_s": r["next"] - r["placed"],
                       "total_s": r["next"] - r["kill"], "killed_after": r["iteration"],
                       "restored": r["restored"], "source": r.get("source") or "disk",
                       "iterations_lost": r["iteration"] - r["restored"],
                       "spare_ranks": r.get("spare_ranks"), "detection_profile": after})
    return {"state": result["state"], "restarts": result["restarts"], "error": result.get("error"), "kills": splits}


def median_split(kills: list[dict]) -> dict:
    """The median of each figure over the kills (and the totals, each)."""
    out = {}
    for key in ("detection_s", "replacement_s", "restore_s", "first_iteration_s", "total_s"):
        values = sorted(k[key] for k in kills)
        out[key] = values[len(values) // 2] if values else float("nan")
    for name in ("death_known", "survivors_reset", "dead_gone"):
        values = sorted(k["detection_profile"][name] for k in kills if name in k["detection_profile"])
        out[name] = values[len(values) // 2] if values else float("nan")
    out["totals"] = [round(k["total_s"], 3) for k in kills]
    out["iterations_lost"] = [k["iterations_lost"] for k in kills]
    out["restored"] = [(k["killed_after"], k["restored"]) for k in kills]
    out["spare_taken"] = sum(1 for k in kills if k["spare_ranks"])
    return out


__all__ = ["ITERS", "SAVE_EVERY", "child_kills", "median_split"]
