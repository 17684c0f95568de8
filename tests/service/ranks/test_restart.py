"""Restart from checkpoints on the process launcher (real gloo ranks, seconds): the whole loss
curve survives a dead rank, a crash in the middle of a save, and a resize to another dp."""

from __future__ import annotations

import os

import pytest

from service.control.events import JobState
from service.control.jobs import start_job
from service.ranks.process_launcher import ProcessLauncher
from service.spec.spec import parse_spec, to_job_config
from workers.rank.faults import Fault

pytestmark = pytest.mark.procs

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             vocab_size=256, seq_length=16)


def make_job(ckpt_dir, iters=8, nodes=2, min_nodes=None, max_restarts=2, save_interval=2, async_save=False):
    return to_job_config(parse_spec({
        "name": "restart", "model": MODEL, "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-3},
        "checkpoint": {"save_interval": save_interval, "dir": str(ckpt_dir), "async_save": async_save},
        "resources": {"num_nodes": nodes, "gpus_per_node": 2, "min_nodes": min_nodes},
        "fault_tolerance": {"max_restarts": max_restarts, "collective_timeout_s": 10, "node_grace_s": 0.2}}))


class ShrinkingLauncher(ProcessLauncher):
    """Local processes, plus a node count the test controls (a stand-in for Ray's node list)."""

    def __init__(self, nodes):
        super().__init__()
        self.nodes = nodes

    def nodes_available(self, gpus_per_node):
        return self.nodes


def run(job, faults=(), launcher=None, on_event=None):
    events = []

    def record(e):
        events.append(e)
        if on_event:
            on_event(e)

    ctrl = start_job(job, launcher=launcher or ProcessLauncher(), on_event=record, faults=list(faults),
                     background=False)
    return ctrl.run(), events


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    result, _ = run(make_job(tmp_path_factory.mktemp("clean")))
    assert result["state"] == "SUCCEEDED" and len(result["losses"]) == 8
    return result["losses"]


def close(a, b, rel=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def starts(events):
    return [e.data for e in events if e.kind == "state" and e.state is JobState.STARTING]


def test_dead_rank_restarts_from_the_latest_checkpoint_and_keeps_the_whole_curve(tmp_path, undisturbed):
    result, events = run(make_job(tmp_path), [Fault(3, 4, "exit")])
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1
    assert close(result["losses"], undisturbed), (result["losses"], undisturbed)
    froms = [s["from_checkpoint"] for s in starts(events)]
    assert froms[0] is None and froms[1].endswith("iter_0000002"), froms
    # iteration 3 ran twice (after the checkpoint of 2); iteration 1 and 2 only once
    its = [e.data["iteration"] for e in events if e.kind == "iteration"]
    assert its == [1, 2, 3, 1 + 2, 4, 5, 6, 7, 8], its
    failure = next(e for e in events if e.kind == "failure")
    assert failure.data["rank"] == 3 and "node" in failure.data and failure.data["dp"] == 1


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, undisturbed):
    result, events = run(make_job(tmp_path), [Fault(1, 4, "save")])
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1
    assert close(result["losses"], undisturbed)
    assert starts(events)[1]["from_checkpoint"].endswith("iter_0000002")  # 4 was never committed
    failure = next(e for e in events if e.kind == "failure")
    assert failure.data["rank"] == 1 and failure.data["code"] == "rank_died", failure.data
    kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("iter_"))
    assert kept == ["iter_0000006", "iter_0000008"]  # keep_last 2


def test_lost_node_shrinks_dp_and_the_curve_does_not_notice(tmp_path, undisturbed):
    launcher = ShrinkingLauncher(2)

    def on_event(e):
        if e.kind == "failure":
            launcher.nodes = 1  # the node of rank 3 is gone for good

    result, events = run(make_job(tmp_path, min_nodes=1), [Fault(3, 5, "exit")], launcher, on_event)
    assert result["state"] == "SUCCEEDED", result
    assert result["sizes"]["dp"] == 1 and result["world_size"] == 2
    assert close(result["losses"], undisturbed), (result["losses"], undisturbed)
    resize = next(e for e in events if e.kind == "resize")
    assert resize.data["old"]["sizes"]["dp"] == 2 and resize.data["new"]["sizes"]["dp"] == 1
    assert len(next(e for e in reversed(events) if e.kind == "placement").data["placement"]) == 2


def test_resume_at_another_dp_from_checkpoint_load(tmp_path, undisturbed):
    first, _ = run(make_job(tmp_path / "a", iters=4))
    assert close(first["losses"], undisturbed[:4])
    job = make_job(tmp_path / "b", nodes=1)
    from dataclasses import replace
    job = replace(job, checkpoint=replace(job.checkpoint, load=str(tmp_path / "a")))
    result, events = run(job)  # dp 1 from the dp 2 checkpoint of iteration 4
    assert starts(events)[0]["from_checkpoint"] == str(tmp_path / "a")
    assert result["state"] == "SUCCEEDED" and close(result["losses"], undisturbed[4:])


def test_max_restarts_exhausted_fails_with_the_reason(tmp_path):
    result, events = run(make_job(tmp_path, max_restarts=1), [Fault(2, 3, "exit"), Fault(2, 4, "exit")])
    assert result["state"] == "FAILED" and result["restarts"] == 1
    assert "rank 2" in result["error"] and "died" in result["error"]
