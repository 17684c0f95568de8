"""How many iterations one run call covers (:mod:`service.control.calls`): about ``call_target_s``
of iterations, never past the next checkpoint save, every iteration still reported."""

from __future__ import annotations

from service.control.calls import CallSizer
from service.control.controller import JobController
from service.control.errors import RankDied
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.controller import MODEL, FakeGroup
from workers.rank.faults import Fault
from workers.grid import ParallelGrid


def test_a_call_covers_the_target_time_and_ends_at_the_next_save():
    sizer = CallSizer(minimum=1, target_s=1.0, save_interval=4)
    assert sizer.size(0, 100) == 1  # nothing measured yet
    sizer.measured(1, 0.1)
    assert sizer.s_per_iteration == 0.1
    assert [sizer.size(it, 100) for it in (0, 1, 3, 4)] == [4, 3, 1, 4]  # to the save at 4, then 8
    assert sizer.size(4, 2) == 2  # not past the end
    assert CallSizer(minimum=1, target_s=1.0).size(0, 100) == 1
    unsaved = CallSizer(minimum=1, target_s=1.0)
    unsaved.measured(5, 0.5)
    assert unsaved.size(7, 100) == 10
    assert CallSizer(minimum=3, target_s=0.0).size(0, 100) == 3  # a fixed size without a target
    assert CallSizer(minimum=3, save_interval=2).size(1, 100) == 1  # a save ends even a fixed call
    slow = CallSizer(minimum=1, target_s=1.0)
    slow.measured(2, 10.0)
    assert slow.size(0, 100) == 1  # iterations longer than the target: one per call


def test_a_drills_iteration_is_a_call_of_its_own():
    sizer = CallSizer(minimum=1, target_s=1.0, save_interval=10)
    sizer.measured(1, 0.01)
    assert sizer.size(0, 100, alone={6}) == 5  # 1..5, then 6 alone
    assert sizer.size(5, 100, alone={6}) == 1
    assert sizer.size(6, 100, alone={6}) == 4  # spent or not, 6 is behind: on to the save at 10
    assert sizer.size(0, 100, alone={1, 3}) == 1 and sizer.size(1, 100, alone={1, 3}) == 1


class CountingGroup(FakeGroup):
    sizes: list[int] = []

    def run(self, iterations):
        self.sizes.append(iterations)
        return super().run(iterations)


def test_the_controller_sizes_its_calls_and_reports_every_iteration():
    """With a target far above the (fake, microseconds) iteration time, each call runs to the next
    save: 1 (measured), 3 (to 4), 4 (to 8), 2 (to the end at 10); every iteration is an event."""
    job = to_job_config(parse_spec({
        "name": "calls", "model": MODEL, "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 2},
        "checkpoint": {"save_interval": 4}, "resources": {"num_nodes": 2, "gpus_per_node": 2}}))
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    CountingGroup.sizes = []
    events = []
    ctrl = JobController(job, grid, job_id="calls", on_event=events.append, call_target_s=1e9,
                         make_group=lambda *_: CountingGroup(4))
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED" and len(result["losses"]) == 10
    assert CountingGroup.sizes == [1, 3, 4, 2]
    # each iteration reported once, tagged by the fake with the number of the call that ran it
    assert [e.data["iteration"] for e in events if e.kind == "iteration"] == [1, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert sum(e.kind == "iteration" for e in events) == 10


class DrilledGroup(FakeGroup):
    """Fails the call that reaches one of its drills' iterations (it has no checkpoints: every
    attempt starts from iteration 0)."""

    def start(self, faults):
        self.done = 0
        return super().start(faults)

    def run(self, iterations):
        hit = [f for f in self.faults if self.done < f.iteration <= self.done + iterations]
        if hit:
            raise RankDied(hit[0].rank, {"node": 0}, "drilled")
        self.done += iterations
        return super().run(iterations)


def test_a_drill_fires_once_when_calls_cover_several_iterations():
    """A drill at iteration 6 with calls of up to 4 iterations: its call is [6] alone, so the
    failed call's first iteration is the drill's and the drill is spent: one restart. Were 6 in
    a call [5, 6], the controller would take 5 as the failed iteration and fire 6 again in every
    attempt until the restarts ran out."""
    job = to_job_config(parse_spec({
        "name": "drilled", "model": MODEL, "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 2},
        "checkpoint": {"save_interval": 4}, "resources": {"num_nodes": 2, "gpus_per_node": 2},
        "fault_tolerance": {"max_restarts": 2}}))
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    ctrl = JobController(job, grid, job_id="drilled", call_target_s=1e9, faults=[Fault(1, 6, "exit")],
                         make_group=lambda *_: DrilledGroup(4))
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1, result
