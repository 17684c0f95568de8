"""Preemption notices stepped against a fake rank group (milliseconds): a drain of a node holding
ranks makes the controller save the current iteration, leave, record PREEMPTED and go on elsewhere,
against its own budget, not max_restarts; and the same through local rank processes, one of which
gets a SIGTERM (seconds). (Through `raytron serve` with `ray drain-node`:
tests/service/server/test_serve_faults.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from service.control.controller import JobController
from service.control.record import count_restarts
from service.control.events import JobState
from service.control.jobs import start_job
from service.control.preemption import PreemptionWatch
from service.ranks.process_launcher import ProcessLauncher
from service.spec.spec import parse_spec, to_job_config
from workers.grid import ParallelGrid
from tests.helpers.elastic import MODEL


def make_job(max_preemptions=10, min_nodes=None, iters=8):
    return to_job_config(parse_spec({
        "name": "pre", "model": MODEL, "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": iters, "global_batch_size": 8, "micro_batch_size": 1},
        "resources": {"num_nodes": 2, "gpus_per_node": 2, "min_nodes": min_nodes},
        "fault_tolerance": {"max_restarts": 0, "max_preemptions": max_preemptions, "node_grace_s": 0.1}}))


class SavingGroup:
    """Fake ranks on ``nodes`` (two per node) that resume from the last ``save_now``; loss 1/iteration.
    ``on_iteration(it)`` runs after each iteration (the test drains a node there)."""

    def __init__(self, world, nodes, saved, on_iteration=lambda it: None):
        self.world, self.nodes, self.saved, self.on_iteration = world, nodes, saved, on_iteration
        self.saves = 0

    def start(self, faults):
        self.it = self.saved[0]
        return [{"rank": r, "node_id": self.nodes[r // 2], "pid": r, "resumed_iteration": self.it}
                for r in range(self.world)]

    def run(self, n):
        out = []
        for _ in range(n):
            self.it += 1
            out.append({"loss": 1.0 / self.it, "iteration": self.it})
            self.on_iteration(self.it)
        return [out] * self.world

    def save_now(self):
        self.saves += 1
        self.saved[0] = self.it
        return [{"iteration": self.it, "save_s": 0.01, "retention": None}] * self.world

    def shutdown(self, keep_warm=False):
        pass

    kill = shutdown


def drill(job, drain_at=3, free_nodes=1):
    """Run ``job`` on a cluster of 2 + ``free_nodes`` nodes; the second node of the first attempt
    (n0, n1) is drained (a 10 s deadline) after iteration ``drain_at``; later attempts run on n0 and
    n2. Returns (result, events, groups)."""
    draining, saved, groups, events = {}, [0], [], []

    def drain(it):
        if it == drain_at:
            draining["n1"] = time.time() + 10

    def make(attempt, attempt_job, grid):
        nodes = ("n0", "n1") if not groups else ("n0", "n2")
        groups.append(SavingGroup(grid.world_size, nodes, saved, drain if not groups else (lambda it: None)))
        return groups[-1]

    ctrl = JobController(job, ParallelGrid.from_config(job.parallel, job.world_size), job_id="pre",
                         make_group=make, on_event=events.append, drain_notices=lambda: dict(draining),
                         nodes_available=lambda: 2 + free_nodes - len(draining))
    return ctrl.run(), events, groups


def test_a_drained_node_saves_the_current_iteration_and_the_job_goes_on_elsewhere_not_as_a_restart():
    result, events, groups = drill(make_job())
    assert result["state"] == "SUCCEEDED", result
    assert result["losses"] == [1.0 / i for i in range(1, 9)]  # the whole curve, no iteration run twice
    assert result["restarts"] == 0 and count_restarts(events) == 0  # max_restarts 0, and still SUCCEEDED
    assert [g.saves for g in groups] == [1, 0] and groups[1].nodes == ("n0", "n2")
    pre = [e for e in events if e.kind == "preempted"]
    assert len(pre) == 1 and pre[0].message.startswith("PREEMPTED: node(s) n1 (ranks [2, 3]) drained")
    data = pre[0].data
    assert data["iteration"] == 3 and data["nodes"] == ["n1"] and data["ranks"] == [2, 3]
    assert 9 < data["before_deadline_s"] <= 10 and data["preemption"] == 1 and data["max_preemptions"] == 10
    moves = [e for e in events if e.kind == "state" and e.state is JobState.RESTARTING]
    assert len(moves) == 1 and moves[0].data["preempted"] and moves[0].data["nodes"] == ["n1"]
    its = [e.data["iteration"] for e in events if e.kind == "iteration"]
    assert its == list(range(1, 9))


def test_preemptions_past_max_preemptions_fail_the_job():
    result, events, _ = drill(make_job(max_preemptions=0))
    assert result["state"] == "FAILED" and result["restarts"] == 0
    assert "max_preemptions is 0" in result["error"], result["error"]
    pre = [e for e in events if e.kind == "preempted"]
    assert len(pre) == 1 and "max_preemptions 0 is spent" in pre[0].message
    assert pre[0].data["iteration"] == 3  # saved all the same


def test_with_no_free_node_an_elastic_job_shrinks_dp():
    result, events, groups = drill(make_job(min_nodes=1), free_nodes=0)
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 0, result
    resize = [e.data for e in events if e.kind == "resize"]
    assert [(r["old"]["sizes"]["dp"], r["new"]["sizes"]["dp"]) for r in resize] == [(2, 1)]
    assert result["losses"] == [1.0 / i for i in range(1, 9)]


def test_a_notice_for_nodes_without_ranks_is_ignored():
    watch = PreemptionWatch(lambda: {"other": None})
    assert watch.check([{"rank": 0, "node_id": "n0"}]) is None
    assert PreemptionWatch(None).check([{"rank": 0, "node_id": "n0"}]) is None
    notice = PreemptionWatch(lambda: {"n0": None, "n1": 5.0}).check(
        [{"rank": 0, "node_id": "n0"}, {"rank": 1, "node_id": "n1"}])
    assert notice.nodes == ("n0", "n1") and notice.ranks == (0, 1) and notice.deadline == 5.0



def test_a_rank_that_got_sigterm_takes_its_whole_node_with_it():
    local = [{"rank": r, "node_id": None, "node": r // 2} for r in range(4)]  # local processes: plan nodes
    notice = PreemptionWatch(None).check(local, {3: 7.0})
    assert notice.nodes == ("node 1",) and notice.ranks == (2, 3) and notice.signalled == (3,)
    assert notice.deadline == 7.0 and PreemptionWatch(None).check(local, {}) is None
    both = PreemptionWatch(lambda: {"node 1": 5.0}).check(local, {3: 7.0})  # the earlier deadline holds
    assert both.deadline == 5.0 and both.nodes == ("node 1",)


PROC_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                  vocab_size=256, seq_length=16)


def proc_job(iters=8):
    return to_job_config(parse_spec({
        "name": "sigterm", "model": PROC_MODEL, "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-3},
        "resources": {"num_nodes": 2, "gpus_per_node": 2},
        "fault_tolerance": {"max_restarts": 0, "sigterm_grace_s": 10, "collective_timeout_s": 10}}))


@pytest.mark.procs
def test_a_rank_process_that_gets_sigterm_saves_the_current_iteration_and_the_job_goes_on(tmp_path):
    """Local rank processes (real gloo ranks): SIGTERM to rank 3 after iteration 2 is a preemption
    notice with the job's 10 s grace: the ranks save iteration 3 (the call under way finishes first)
    before the deadline, that attempt ends, the next resumes from the checkpoint, every iteration runs
    once on the undisturbed curve (1e-6), one PREEMPTED event, and `restarts` stays 0 with max_restarts 0."""
    events, sent = [], []

    def on_event(e):
        events.append(e)
        if e.kind == "iteration" and e.data["iteration"] == 2 and not sent:
            pid = next(p["pid"] for p in placement[-1] if p["rank"] == 3)
            os.kill(pid, signal.SIGTERM)  # between calls: the rank is waiting for its next command
            sent.append((pid, time.time()))
        elif e.kind == "placement":
            placement.append(e.data["placement"])

    placement: list = []
    result = start_job(proc_job(), launcher=ProcessLauncher(), on_event=on_event, background=False,
                       checkpoint_root=str(tmp_path)).run()
    clean = start_job(proc_job(), launcher=ProcessLauncher(), background=False).run()  # no checkpoints
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 0 and count_restarts(events) == 0, result
    assert len(result["losses"]) == 8 and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(result["losses"],
                                                                                          clean["losses"]))
    pre = [e for e in events if e.kind == "preempted"]
    assert len(pre) == 1 and "rank(s) [3] got SIGTERM" in pre[0].message, [e.message for e in events]
    data, (pid, when) = pre[0].data, sent[0]
    assert data["signalled"] == [3] and data["ranks"] == [2, 3] and data["nodes"] == ["node 1"], data
    assert data["iteration"] == 3 and when < data["saved_time"] < data["deadline"] <= when + 10.5, (when, data)
    manifest = json.loads((Path(data["checkpoint"]) / "manifest.json").read_text())
    assert manifest["iteration"] == 3 and manifest["created_unix"] < data["saved_time"]
    assert [e.data["iteration"] for e in events if e.kind == "iteration"] == list(range(1, 9))
    starts = [e.data for e in events if e.kind == "state" and e.state is JobState.STARTING]
    assert len(starts) == 2 and starts[1]["from_checkpoint"] == data["checkpoint"]
    assert pid not in {p["pid"] for p in placement[-1]}  # the signalled process left; new ones took over


@pytest.mark.parametrize("section, needle", [
    ({"max_preemptions": -1}, "fault_tolerance.max_preemptions: Input should be greater than or equal to 0, got -1"),
    ({"sigterm_grace_s": 0}, "fault_tolerance.sigterm_grace_s: Input should be greater than 0, got 0"),
    ({"max_preemptions": 1.5}, "fault_tolerance.max_preemptions: Input should be a valid integer"),
])
def test_a_bad_preemption_budget_or_grace_is_refused_in_one_line_before_anything_starts(tmp_path, capsys, section,
                                                                                        needle):
    from api.cli.main import main

    spec = {"name": "bad", "model": PROC_MODEL, "training": {"train_iters": 2, "global_batch_size": 2,
                                                            "micro_batch_size": 1},
            "resources": {"num_nodes": 1, "gpus_per_node": 1}, "fault_tolerance": section}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    assert main(["run", str(path), "--launcher", "processes"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
