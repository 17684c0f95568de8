"""Failures, restarts and cancel through the one orchestration path, on the process launcher.

Real rank processes (gloo on loopback), world size 4 (tp 2 x pp 2), a model small enough that
an attempt takes about a second: every drill here runs in seconds. The same controller and
failure triage drive the Ray launcher (test_ray.py).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from service.control.errors import RankDied, RankHung, RankRaised
from service.control.events import JobState
from service.control.jobs import start_job
from service.ranks.process_launcher import ProcessLauncher
from service.spec.spec import parse_spec, to_job_config
from workers.rank.faults import Fault

pytestmark = pytest.mark.procs

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             vocab_size=256, seq_length=16)


def spec(max_restarts=1, timeout=5, iters=4, lr=3e-3, nodes=1, memory_interval=0) -> dict:
    return {"name": "drill", "model": MODEL,
            "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 1, "lr": lr},
            "resources": {"num_nodes": nodes, "gpus_per_node": 4 // nodes},
            "fault_tolerance": {"max_restarts": max_restarts, "collective_timeout_s": timeout,
                                "memory_interval": memory_interval}}


def run(faults=(), on_event=None, **kw):
    job = to_job_config(parse_spec(spec(**kw)))
    events, holder = [], {}

    def record(event):
        events.append(event)
        if on_event is not None and holder:
            on_event(event, holder["controller"])

    holder["controller"] = start_job(job, launcher=ProcessLauncher(), on_event=record, faults=list(faults),
                                     background=False)
    return holder["controller"].run(), holder["controller"], events


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def undisturbed():
    result, _, _ = run()
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 0 and len(result["losses"]) == 4
    return result["losses"]


@pytest.mark.parametrize("kind,error", [("raise", RankRaised), ("exit", RankDied), ("hang", RankHung)])
def test_restart_after_a_drill_gives_the_undisturbed_curve(undisturbed, kind, error):
    result, ctrl, events = run([Fault(2, 2, kind)])
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1
    assert result["losses"] == pytest.approx(undisturbed, rel=1e-6)
    failure = [e for e in events if e.kind == "failure"]
    assert len(failure) == 1 and failure[0].data["code"] == error.code
    data = failure[0].data
    assert data["rank"] == 2 and (data["tp"], data["pp"], data["dp"], data["cp"], data["ep"]) == (0, 1, 0, 0, 0)
    assert data["node"] == 0 and data["pid"] == [p for p in events if p.kind == "placement"][0].data["placement"][2]["pid"]
    if kind == "hang":
        assert data["group"] == "pp" and "its peers gave up on it" in data["cause"]  # pp stage 1 waits on a recv
    assert [e.state for e in events if e.kind == "state"] == [
        JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.RESTARTING, JobState.STARTING,
        JobState.RUNNING, JobState.SUCCEEDED]
    assert alive(p["pid"] for e in events if e.kind == "placement" for p in e.data["placement"]) == []


def test_max_restarts_zero_fails_naming_the_rank():
    result, ctrl, _ = run([Fault(1, 3, "exit")], max_restarts=0)
    assert result["state"] == "FAILED" and result["restarts"] == 0 and result["iterations"] == 2
    assert isinstance(ctrl.error, RankDied) and ctrl.error.rank == 1
    assert result["error"].startswith("rank 1 (node 0, ") and "exited with code 1" in result["error"]


def test_a_rank_stopped_with_sigstop_is_named_and_replaced(undisturbed):
    stopped = {}

    def stop_rank_1(event, ctrl):
        if event.kind == "iteration" and event.data["iteration"] == 2 and not stopped:
            stopped["pid"] = ctrl.placement[1]["pid"]
            os.kill(stopped["pid"], signal.SIGSTOP)

    result, ctrl, events = run(on_event=stop_rank_1)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1
    assert result["losses"] == pytest.approx(undisturbed, rel=1e-6)
    failure = [e for e in events if e.kind == "failure"][0].data
    assert failure["code"] == RankHung.code and failure["rank"] == 1 and failure["pid"] == stopped["pid"]
    assert alive([stopped["pid"]]) == []  # SIGKILL reaches a stopped process


def test_a_rank_killed_restores_from_memory_with_the_survivors_kept(undisturbed):
    """memory_interval 1 on two simulated nodes: SIGKILL rank 1 during iteration 3; the other
    three processes stay, rank 1 starts anew, and every rank restores iteration 2 from memory."""
    killed = {}

    def kill_rank_1(event, ctrl):
        if event.kind == "iteration" and event.data["iteration"] == 2 and not killed:
            killed["pid"] = ctrl.placement[1]["pid"]
            threading.Timer(0.05, os.kill, (killed["pid"], signal.SIGKILL)).start()  # inside the next call

    result, ctrl, events = run(on_event=kill_rank_1, nodes=2, memory_interval=1)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1
    assert result["losses"] == pytest.approx(undisturbed, rel=1e-6)
    failure = next(e for e in events if e.kind == "failure").data
    assert failure["code"] == RankDied.code and failure["rank"] == 1 and "SIGKILL" in failure["cause"]
    done = [e.data["iteration"] for e in events if e.kind == "iteration"]
    cut = next(i for i, e in enumerate(events) if e.kind == "restore")
    last = max(e.data["iteration"] for e in events[:cut] if e.kind == "iteration")  # recorded before the restore
    assert done == list(range(1, 5))  # none recorded twice: none computed again
    (restore,) = [e for e in events if e.kind == "restore"]
    assert restore.data["source"] == "memory" and restore.data["iteration"] == last and restore.data["from_replicas"] == [1]
    first, second = [[p for p in e.data["placement"]] for e in events if e.kind == "placement"]
    assert [p["pid"] == q["pid"] for p, q in zip(first, second)] == [True, False, True, True]
    assert [bool(p.get("reused")) for p in second] == [True, False, True, True]
    assert {p["node"] for p in second} == {0, 1} and second[1]["resumed_from"].startswith("memory (replica from rank")
    assert alive(p["pid"] for p in first + second) == []


def test_cancel_stops_every_rank():
    pids = []

    def cancel_at_2(event, ctrl):
        if event.kind == "placement":
            pids.extend(p["pid"] for p in event.data["placement"])
        if event.kind == "iteration" and event.data["iteration"] == 2:
            threading.Thread(target=ctrl.cancel, args=("user asked",)).start()

    result, ctrl, events = run(on_event=cancel_at_2, iters=50)
    assert result["state"] == "CANCELLED" and 2 <= result["iterations"] < 50
    assert [e.state for e in events if e.kind == "state"][-1] is JobState.CANCELLED
    assert not [e for e in events if e.kind == "failure"]  # the kill is not reported as a rank failure
    assert len(pids) == 4 and alive(pids) == []


def test_non_finite_loss_fails_the_job_at_that_iteration():
    result, ctrl, _ = run(lr=1e30, max_restarts=3)
    assert result["state"] == "FAILED" and result["restarts"] == 0
    bad = ctrl.error.iteration
    assert result["iterations"] == bad - 1 and f"iteration {bad}: lm loss is" in result["error"]
