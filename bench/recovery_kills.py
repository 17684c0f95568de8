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
(:func:`~service.ranks.ray_survivors.survivors_of`), the dead actors known dead (``kill_and_wait``);
*replacement* by each rank's timeline (its placement record's ``timeline``, :func:`rank_profile`)
and the driver's marks of the attempt's start (spares taken, the calls answered).
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

    collect = rl.RayRankGroup._collect

    def collect_marked(self, refs, timeout_s, *, what, **kwargs):  # each call of the attempt's start, when it ended
        try:
            return collect(self, refs, timeout_s, what=what, **kwargs)
        except BaseException:
            marks.append(("death_known", time.time()))
            raise
        finally:
            marks.append((f"driver: {what} calls answered", time.time()))

    start = rl.RayRankGroup.start

    def start_marked(self, faults):
        marks.append(("driver: start", time.time()))
        return start(self, faults)

    rl.RayRankGroup._collect, rl.RayRankGroup.start = collect_marked, start_marked
    rl.survivors_of = timed("survivors_reset", rl.survivors_of)
    rl.kill_and_wait = timed("dead_gone", rl.kill_and_wait)
    rl.spare_ranks = timed("driver: spares taken", rl.spare_ranks)
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
                cur["timelines"] = [(p["rank"], _kind(p), p.get("timeline")) for p in e.data["placement"]]
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
        # One iteration per call in every mode: each path's first iteration after a recovery is then
        # known when it ends, not at the end of a second-long call.
        launcher.config = replace(launcher.config, call_target_s=0.0)
        make = launcher.make_group
        launcher.make_group = lambda *a, **k: groups.append(make(*a, **k)) or groups[-1]
        result = start_job(job, launcher=launcher, on_event=on_event).wait()
    splits = []
    for r in rounds:
        if "next" not in r:
            continue
        after, driver = {}, {}
        for name, t in marks:
            if r["kill"] <= t <= r["failure"] and name not in after:
                after[name] = t - r["kill"]
            if name.startswith("driver:") and r["failure"] <= t <= r["placed"] and name not in driver:
                driver[name] = t - r["failure"]
        splits.append({"detection_s": r["failure"] - r["kill"], "replacement_s": r["placed"] - r["failure"] - r["load"],
                       "restore_s": r["load"], "first_iteration_s": r["next"] - r["placed"],
                       "total_s": r["next"] - r["kill"], "killed_after": r["iteration"],
                       "restored": r["restored"], "source": r.get("source") or "disk",
                       "iterations_lost": r["iteration"] - r["restored"],
                       "spare_ranks": r.get("spare_ranks"), "detection_profile": after,
                       "driver": driver, "ranks": _rank_steps(r.get("timelines") or [], r["kill"])})
    return {"state": result["state"], "restarts": result["restarts"], "error": result.get("error"), "kills": splits,
            "losses": result["losses"]}


def _kind(p: dict) -> str:
    return "spare" if p.get("spare") else "kept" if p.get("reused") else "new"


def _rank_steps(timelines: list, killed: float) -> dict:
    """Per kind of rank (kept in place, a spare taking a rank, a new actor): per step, the slowest
    rank's wall seconds and the CPU seconds of all of them together; ``began``: when the slowest
    one's recovery began, after the kill (a spare's: when its start-up ended, before it)."""
    out: dict = {}
    for _, kind, tl in timelines:
        if not tl:
            continue
        mine = out.setdefault(kind, {"ranks": 0, "began": -1e9, "steps": {}})
        mine["ranks"] += 1
        mine["began"] = max(mine["began"], tl["began"] - killed)
        for name, wall, cpu in tl["steps"]:
            w, c = mine["steps"].get(name, (0.0, 0.0))
            mine["steps"][name] = (max(w, wall), c + cpu)
    return out


def rank_profile(kills: list[dict]) -> list[str]:
    """The per-rank timeline of the kills as lines: per kind of rank and step, the median over the
    kills of the slowest rank's wall seconds and of the ranks' CPU seconds together; then the
    driver's marks after the failure event (medians)."""
    lines = []
    kinds = sorted({k for kill in kills for k in kill.get("ranks", {})})
    for kind in kinds:
        have = [kill["ranks"][kind] for kill in kills if kind in kill.get("ranks", {})]
        began = sorted(h["began"] for h in have)[len(have) // 2]
        lines.append(f"  {kind} ranks ({have[0]['ranks']}), recovery began {began:+.2f} s after the kill:"
                     f" step: slowest rank's wall / all their CPU (s)")
        names = list(dict.fromkeys(n for h in have for n in h["steps"]))
        for name in names:
            vals = [h["steps"][name] for h in have if name in h["steps"]]
            wall = sorted(v[0] for v in vals)[len(vals) // 2]
            cpu = sorted(v[1] for v in vals)[len(vals) // 2]
            lines.append(f"    {name:<40}{wall:>7.3f} /{cpu:>6.3f}")
    names = list(dict.fromkeys(n for kill in kills for n in kill.get("driver", {})))
    if names:
        lines.append("  driver, after the failure event (s):")
    for name in sorted(names, key=lambda n: sorted(k["driver"].get(n, 0) for k in kills)[len(kills) // 2]):
        vals = sorted(k["driver"][name] for k in kills if name in k["driver"])
        lines.append(f"    {name[8:]:<40}{vals[len(vals) // 2]:>7.3f}")
    return lines


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


__all__ = ["ITERS", "SAVE_EVERY", "child_kills", "median_split", "rank_profile"]
