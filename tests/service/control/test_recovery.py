"""The restore event of a restarted attempt with in-memory checkpoints (service/control/recovery.py), and
the iterations a failed call finished, recorded from memory by the controller."""

from service.control.controller import JobController
from service.control.errors import RankDied
from service.control.events import JobState
from service.control.recovery import restore_event
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.controller import MODEL
from workers.grid import ParallelGrid


def test_memory_restore_names_the_ranks_that_took_replicas():
    placement = [{"rank": 0, "resumed_from": "memory (own)"}, {"rank": 1, "resumed_from": "memory (replica from rank 3)"}]
    e = restore_event(JobState.STARTING, 6, "/ck/iter_0000005", placement)
    assert e.kind == "restore" and e.data == {"iteration": 6, "source": "memory", "from_replicas": [1],
                                              "spare_ranks": []}
    assert e.message == ("restored iteration 6 from memory: ranks [1] from their replicas on other nodes, "
                         "the others from their own copies")


def test_a_restore_on_a_hot_spare_says_so():
    placement = [{"rank": 0, "resumed_from": "memory (replica from rank 2)", "spare": True},
                 {"rank": 1, "resumed_from": "memory (replica from rank 3)", "spare": True},
                 {"rank": 2, "resumed_from": "memory (own)", "spare": False}]
    e = restore_event(JobState.STARTING, 6, None, placement)
    assert e.data["spare_ranks"] == [0, 1] == e.data["from_replicas"]
    assert e.message.endswith("; ranks [0, 1] on a hot spare node (resources.spare_nodes)")


def test_a_fall_back_to_disk_says_why():
    why = "both copies of rank(s) [1]'s in-memory state are lost"
    placement = [{"rank": 0, "resumed_from": "/ck/iter_0000005", "restore_note": why}, {"rank": 1, "resumed_from": "/ck/iter_0000005"}]
    e = restore_event(JobState.STARTING, 5, "/ck/iter_0000005", placement)
    assert e.data["source"] == "disk" and e.data["iteration"] == 5 and e.data["why"] == why
    assert e.message == f"restored iteration 5 from the disk checkpoint /ck/iter_0000005: {why}"
    assert restore_event(JobState.STARTING, 0, None, [{"rank": 0}]).data["source"] == "start"


class MemoryGroup:
    """Ranks with in-memory snapshots, scripted: the first attempt's call that reaches iteration 7 fails
    there (its ranks finished the iterations before it); the next attempt restores iteration 6 from
    memory and hands the iterations that call finished back as rank 0's ``caught_up``."""

    sizes: list = []
    first_call_ends = 0  # the iterations recorded before the failed call

    def __init__(self, attempt: int):
        self.attempt, self.done = attempt, 0

    def start(self, faults):
        self.done = 0 if self.attempt == 0 else 6
        placement = [{"rank": r, "node_id": f"n{r // 2}", "pid": 10 * self.attempt + r, "resumed_iteration": self.done,
                      "resumed_from": "memory (own)" if self.done else None, "caught_up": None} for r in range(4)]
        if self.attempt:
            placement[0]["caught_up"] = [_metrics(i) for i in range(self.first_call_ends + 1, 7)]
        return placement

    def run(self, n):
        MemoryGroup.sizes.append(n)
        if self.attempt == 0 and self.done < 7 <= self.done + n:
            MemoryGroup.first_call_ends = self.done
            raise RankDied(3, {"node": 1, "node_id": "n1", "pid": 3}, "actor died")  # during iteration 7
        out = [_metrics(self.done + i + 1) for i in range(n)]
        self.done += n
        return [out] * 4

    def shutdown(self, keep_warm=False):
        pass

    def kill(self):
        pass


def _metrics(iteration: int) -> dict:
    return {"iteration": iteration, "loss": 10.0 / iteration}


def test_the_iterations_a_failed_call_finished_come_back_from_memory_not_run_again():
    """memory_interval 1 does not end calls (each covers as many iterations as the target asks: here
    1 (measured), then the rest, in each attempt); the failed call's finished iterations (2..6) are
    recorded from rank 0's ``caught_up``, once, before the restored attempt runs on from iteration 6."""
    job = to_job_config(parse_spec({
        "name": "caught", "model": MODEL, "parallel": {"tensor_model_parallel_size": 2},
        "training": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 2},
        "checkpoint": {"save_interval": 20, "dir": "/tmp/raytron-unused"},
        "fault_tolerance": {"memory_interval": 1, "max_restarts": 1}, "resources": {"num_nodes": 2, "gpus_per_node": 2}}))
    grid = ParallelGrid.from_config(job.parallel, job.world_size)
    MemoryGroup.sizes = []
    events = []
    ctrl = JobController(job, grid, job_id="caught", on_event=events.append, call_target_s=1e9,
                         make_group=lambda attempt, *_: MemoryGroup(attempt))
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED" and result["restarts"] == 1
    assert MemoryGroup.sizes == [1, 9, 1, 3]  # calls are not cut at the snapshots; an attempt's first is 1
    assert [e.data["iteration"] for e in events if e.kind == "iteration"] == list(range(1, 11))  # each once
    assert result["losses"] == [10.0 / i for i in range(1, 11)]
    kinds = [e.kind for e in events]
    failure, restore = kinds.index("failure"), kinds.index("restore")
    assert [e.data["iteration"] for e in events[failure:restore] if e.kind == "iteration"] == [2, 3, 4, 5, 6]
    assert events[restore].data["iteration"] == 6 and events[restore].data["source"] == "memory"
    placed = [e for e in events if e.kind == "placement"][-1]
    assert all("caught_up" not in p for p in placed.data["placement"])  # recorded, not carried in the placement
