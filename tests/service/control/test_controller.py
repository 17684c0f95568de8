"""The job controller's state machine stepped against a fake rank group: no processes, no Ray,
milliseconds. (The same controller drives the process and Ray launchers: test_launchers.py,
test_ray.py.)"""

from __future__ import annotations

import json
import math

import pytest

from service.control.controller import JobController
from service.control.errors import NonFiniteMetric, RankDied, RankHung, RankRaised, is_root_cause
from service.control.events import JobEvent, JobState
from service.control.policy import Decision, FailFast, RestartUpTo
from service.spec.spec import parse_spec, to_job_config
from workers.rank.faults import Fault
from workers.grid import ParallelGrid
from tests.helpers.controller import FakeGroup, MODEL  # noqa: F401


def make_job(iters=3, max_restarts=3):
    job = to_job_config(parse_spec({
        "name": "fake", "model": MODEL, "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": iters, "global_batch_size": 4, "micro_batch_size": 2},
        "resources": {"num_nodes": 2, "gpus_per_node": 2}, "fault_tolerance": {"max_restarts": max_restarts}}))
    return job, ParallelGrid.from_config(job.parallel, job.world_size)


def states(events):
    return [e.state for e in events if e.kind == "state"]


def test_states_and_events():
    job, grid = make_job()
    groups, events = [], []
    ctrl = JobController(job, grid, job_id="j1", on_event=events.append,
                         make_group=lambda attempt, *_: groups.append(FakeGroup(4)) or groups[-1])
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED" and result["losses"] == [1.0, 0.5, 1.0 / 3]
    assert states(events) == [JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED]
    assert [e.kind for e in events].count("iteration") == 3 and groups[0].shut
    assert all(a.time <= b.time for a, b in zip(events, events[1:]))
    assert JobState.SUCCEEDED.is_terminal and not JobState.RESTARTING.is_terminal
    assert JobState.RESTARTING.needs_new_attempt and json.dumps([e.to_dict() for e in events])


def test_max_restarts_drives_the_default_policy():
    assert FailFast().decide(RankDied(0, {}, "x"), 0) is Decision.FAIL
    assert RestartUpTo(1).decide(RankDied(0, {}, "x"), 0) is Decision.RESTART
    assert RestartUpTo(1).decide(RankDied(0, {}, "x"), 1) is Decision.FAIL
    for max_restarts, expected in ((1, "SUCCEEDED"), (0, "FAILED")):
        job, grid = make_job(max_restarts=max_restarts)
        groups = []

        def make(attempt, *_):
            groups.append(FakeGroup(4, fail_on_call=2 if attempt == 0 else None))
            return groups[-1]

        ctrl = JobController(job, grid, job_id="j2", make_group=make)  # no policy given: the spec's
        result = ctrl.run()
        assert result["state"] == expected and result["restarts"] == max_restarts
        assert all(g.shut for g in groups) and len(groups) == 1 + max_restarts
        if expected == "SUCCEEDED":
            assert len(result["losses"]) == 3 and JobState.RESTARTING in states(ctrl.events)
        else:
            assert "rank 1" in result["error"] and "n0" in result["error"]


def test_cancel():
    job, grid = make_job(iters=5)
    group = FakeGroup(4)
    ctrl = JobController(job, grid, job_id="j4", make_group=lambda a, *_: group,
                         on_event=lambda e: e.kind == "iteration" and ctrl.cancel("user asked"))
    result = ctrl.run()
    assert result["state"] == "CANCELLED" and result["iterations"] == 1 and group.shut
    assert ctrl.events[-1].message == "user asked"


def test_non_finite_loss_fails_at_that_iteration_and_is_not_restarted():
    job, grid = make_job(iters=4, max_restarts=3)
    groups = []
    ctrl = JobController(job, grid, job_id="nan", make_group=lambda a, *_: groups.append(
        FakeGroup(4, loss=lambda call: math.nan if call == 3 else 2.0)) or groups[-1])
    result = ctrl.run()
    assert result["state"] == "FAILED" and result["restarts"] == 0 and len(groups) == 1
    assert isinstance(ctrl.error, NonFiniteMetric) and ctrl.error.iteration == 3
    assert "iteration 3: lm loss is nan" in result["error"] and result["losses"] == [2.0, 2.0]
    json.dumps(result, allow_nan=False)


def test_non_finite_grad_norm_fails_the_job_too():
    job, grid = make_job(iters=4)
    group = FakeGroup(4)
    run = group.run
    group.run = lambda n: [[{**m, "grad_norm": math.inf if m["iteration"] == 2 else 0.5} for m in ms]
                           for ms in run(n)]
    ctrl = JobController(job, grid, job_id="gn", make_group=lambda a, *_: group)
    result = ctrl.run()
    assert result["state"] == "FAILED" and "iteration 2: grad norm is inf" in result["error"]
    assert result["grad_norm"] == [0.5] and result["restarts"] == 0


def test_a_fault_fires_once_and_later_ones_carry_over():
    job, grid = make_job(iters=5)
    groups = []

    def make(attempt, *_):
        groups.append(FakeGroup(4, fail_on_call=2 if attempt == 0 else None))
        return groups[-1]

    faults = [Fault(1, 2, "exit"), Fault(0, 4, "raise")]
    JobController(job, grid, job_id="f", make_group=make, faults=faults).run()
    assert groups[0].faults == faults and groups[1].faults == [Fault(0, 4, "raise")]
    with pytest.raises(ValueError, match="rank 4 is outside the job's 4 ranks"):
        JobController(job, grid, job_id="f", make_group=make, faults=[Fault(4, 1)])


def test_controller_rebuilt_from_its_events_does_not_queue_twice():
    job, grid = make_job(iters=3)
    recorded = []
    JobController(job, grid, job_id="r", make_group=lambda a, *_: FakeGroup(4), on_event=recorded.append)
    stored = [e.to_dict() for e in recorded]  # what a job store keeps: QUEUED only, never ran
    replayed = [JobEvent.from_dict(d) for d in json.loads(json.dumps(stored))]
    emitted = []
    ctrl = JobController(job, grid, job_id="r", make_group=lambda a, *_: FakeGroup(4), on_event=emitted.append,
                         history=replayed)
    assert emitted == [] and ctrl.state is JobState.QUEUED
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED" and states(ctrl.events).count(JobState.QUEUED) == 1
    assert JobState.QUEUED not in states(emitted)


def test_controller_rebuilt_mid_run_starts_a_new_attempt():
    job, grid = make_job(iters=4)
    recorded = []
    ctrl = JobController(job, grid, job_id="m", make_group=lambda a, *_: FakeGroup(4), on_event=recorded.append)
    ctrl.run()
    cut = [i for i, e in enumerate(recorded) if e.kind == "iteration"][1] + 1  # the service died after 2 iterations
    emitted = []
    rebuilt = JobController(job, grid, job_id="m", make_group=lambda a, *_: FakeGroup(4), on_event=emitted.append,
                            history=recorded[:cut])
    assert rebuilt.losses == [1.0, 0.5] and rebuilt.state is JobState.RESTARTING
    result = rebuilt.run()
    assert result["state"] == "SUCCEEDED" and result["iterations"] == 4 and result["restarts"] == 1
    assert states(emitted)[0] is JobState.RESTARTING and JobState.QUEUED not in states(emitted)
    done = JobController(job, grid, job_id="m", make_group=lambda a, *_: FakeGroup(4), history=rebuilt.events)
    assert done.run()["state"] == "SUCCEEDED"  # a terminal job replays to its result, starts nothing


def test_a_rebuilt_controller_does_not_fire_again_the_drills_its_record_reached():
    """A drill fires once per job, also across controllers: a controller rebuilt from a record in
    which a drill failed the job at iteration 2 and the next attempt finished iteration 3 drops
    the drills at or before those iterations, and keeps the later one for its ranks."""
    job, grid = make_job(iters=6)
    faults = [Fault(1, 2, "raise"), Fault(0, 3, "exit"), Fault(0, 5, "raise")]
    it = lambda n: JobEvent.now("iteration", JobState.RUNNING, "", {"iteration": n, "loss": 1.0 / n})  # noqa: E731
    state = lambda s: JobEvent.now("state", s, "", {})  # noqa: E731
    history = [state(JobState.QUEUED), state(JobState.STARTING), state(JobState.RUNNING), it(1),
               JobEvent.now("failure", JobState.RUNNING, "rank 1 raised", {"code": "rank_raised", "rank": 1}),
               JobEvent.now("state", JobState.RESTARTING, "restart 1", {}), state(JobState.STARTING),
               state(JobState.RUNNING), it(2), it(3)]
    groups = []

    def make(attempt, *_):
        groups.append(FakeGroup(4))
        return groups[-1]

    rebuilt = JobController(job, grid, job_id="d", make_group=make, history=history, faults=faults)
    assert rebuilt.faults == [Fault(0, 5, "raise")]  # mutation: no pruning on replay -> the drill at 2 fires again
    rebuilt.run()
    assert groups[0].faults == [Fault(0, 5, "raise")]


def test_root_cause_is_the_rank_that_broke_not_its_peers():
    assert is_root_cause(RankDied(3, {}, "The actor died unexpectedly"))
    assert is_root_cause(RankHung(3, {}, "stopped"))
    assert is_root_cause(RankRaised(1, {}, "InjectedFault: rank 1: injected fault before iteration 2"))
    assert not is_root_cause(RankRaised(2, {}, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1"))
    assert not is_root_cause(RankRaised(2, {}, "RuntimeError: Timed out waiting 20000ms for recv operation"))


def test_result_object_has_no_bare_nan():
    from service.control.result import result_object

    job, grid = make_job()
    metrics = [{"loss": 2.0, "grad_norm": math.inf}, {"loss": math.nan, "grad_norm": 1.0}]
    out = result_object("j", "FAILED", grid, metrics, [], error="x")
    assert out["losses"] == [2.0, None] and out["grad_norm"] == [None, 1.0] and "moe_aux_loss" not in out
    json.dumps(out, allow_nan=False)


def test_a_restart_resumes_from_the_last_checkpoint_whose_iterations_it_recorded(tmp_path):
    """The ranks can save iteration k's checkpoint and die before the call returns k's metrics:
    resuming from k would leave k out of the curve, so the restart takes the checkpoint before."""
    from dataclasses import replace

    from tests.helpers.checkpoints import checkpointer, trained

    ck = checkpointer(tmp_path, keep_last=2)
    t = trained(2)
    ck.save(t)
    t.train_step()
    t.train_step()
    ck.save(t)  # iterations 2 and 4 on disk
    job, grid = make_job(iters=5)
    job = replace(job, checkpoint=replace(job.checkpoint, dir=str(tmp_path)))

    def make(attempt, *_):  # the first attempt records iterations 1-3, then a rank dies
        return FakeGroup(4, fail_on_call=4 if attempt == 0 else None)

    ctrl = JobController(job, grid, job_id="j-ckpt", make_group=make)
    assert ctrl.run()["state"] == "SUCCEEDED"
    starts = [e.data["from_checkpoint"] for e in ctrl.events if e.kind == "state" and e.state is JobState.STARTING]
    assert starts[0].endswith("iter_0000004")  # a first attempt takes the latest
    assert starts[1].endswith("iter_0000002"), starts  # not iteration 4: its metrics never arrived
