"""Re-pick the layout on an elastic resize (``fault_tolerance.relayout_on_resize``,
:mod:`service.control.relayout`): the decision as a pure function, its refusal without an elastic
floor, and a drill on real processes: a rank's node is lost at iteration 3 of a tp 2 job on 2 x 2,
the next attempt runs on the node left in the layout the cost model re-picks (tp 1, dp 2), resumed
from the checkpoint of iteration 2, and the loss curve is that of an undisturbed run."""

from __future__ import annotations

import pytest

from service.control.controller import JobController
from service.control.events import JobState
from service.control.policy import ElasticDataParallel, resized
from service.control.relayout import ElasticRelayout, predicted_step_s
from service.ranks.process_launcher import ProcessLauncher
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.drills import close, undisturbed
from workers.rank.faults import Fault
from workers.grid import ParallelGrid

MODEL = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "vocab_size": 256,
         "seq_length": 32}


def spec(nodes=2, gpus=2, parallel=None, relayout=True, min_nodes=1, ckpt="/nonexistent-raytron-test", iters=8):
    return {"name": "relayout", "model": MODEL, "parallel": parallel or {"tensor_model_parallel_size": 2},
            "training": {"train_iters": iters, "global_batch_size": 8, "micro_batch_size": 1, "lr": 3e-3},
            "checkpoint": {"save_interval": 2, "dir": ckpt},
            "resources": {"num_nodes": nodes, "gpus_per_node": gpus, "min_nodes": min_nodes},
            "fault_tolerance": {"max_restarts": 2, "node_grace_s": 0.1, "relayout_on_resize": relayout}}


def test_a_shrunk_tp2_job_is_repicked_to_the_layout_the_model_predicts_faster():
    job = to_job_config(parse_spec(spec()))
    dp_only = ElasticDataParallel().decide(job, 1)
    assert dp_only.num_nodes == 1 and dp_only.sizes["tp"] == 2 and dp_only.sizes["dp"] == 1
    decision = ElasticRelayout().decide(job, 1)
    assert decision.num_nodes == 1 and decision.parallel is not None
    assert (decision.sizes["tp"], decision.sizes["dp"]) == (1, 2)
    assert decision.parallel.tensor_model_parallel_size == 1
    small = resized(job, 1, decision.parallel)
    assert small.world_size == 2 and small.training.global_batch_size == 8
    assert ParallelGrid.from_config(small.parallel, small.world_size).sizes() == decision.sizes
    # the gain the decision names is the cost model's: predicted times of both layouts on one node
    on_one = spec(nodes=1, relayout=False, min_nodes=None)
    repicked = predicted_step_s({**on_one, "parallel": {"tensor_model_parallel_size": 1}})
    kept = predicted_step_s(on_one)
    assert repicked < kept * 0.95 and f"{kept:.4g} s for dp alone" in decision.reason
    # without the option, or at full size, the job keeps its layout
    assert ElasticRelayout().decide(to_job_config(parse_spec(spec(relayout=False))), 1).parallel is None
    assert ElasticRelayout().decide(job, 2).parallel is None


def test_relayout_without_an_elastic_floor_is_refused():
    with pytest.raises(ValueError, match="relayout_on_resize .* resources.min_nodes None is not below num_nodes 2"):
        parse_spec(spec(min_nodes=None))


class LosingLauncher(ProcessLauncher):
    """Local processes on ``nodes`` simulated nodes; ``nodes[0]`` is what the cluster offers now."""

    def __init__(self, nodes: list[int]):
        super().__init__()
        self.nodes = nodes

    def nodes_available(self, gpus_per_node: int) -> int:
        return self.nodes[0]


@pytest.mark.procs
def test_a_lost_node_relayouts_from_the_checkpoint_and_keeps_the_loss_curve(tmp_path):
    s = spec(ckpt=str(tmp_path / "ckpt"))
    job = to_job_config(parse_spec(s))
    nodes, events = [2], []

    def on_event(e):
        events.append(e)
        if e.kind == "iteration" and e.data["iteration"] == 2:
            nodes[0] = 1  # node 1 is lost: its rank 3 exits in iteration 3 (the fault below)

    launcher = LosingLauncher(nodes)
    ctrl = JobController(job, ParallelGrid.from_config(job.parallel, job.world_size), job_id="relayout",
                         make_group=lambda attempt, j, g: launcher.make_group(j, g, attempt, job_id="relayout"),
                         on_event=on_event, faults=[Fault(3, 3, "exit")], nodes_available=lambda: nodes[0])
    result = ctrl.run()
    assert result["state"] == "SUCCEEDED", result
    resize = [e for e in events if e.kind == "resize"]
    assert len(resize) == 1
    old, new = resize[0].data["old"], resize[0].data["new"]
    assert (old["num_nodes"], old["sizes"]["tp"], old["sizes"]["dp"]) == (2, 2, 2)
    assert (new["num_nodes"], new["sizes"]["tp"], new["sizes"]["dp"]) == (1, 1, 2)
    assert "tp 2 -> 1" in resize[0].message
    starts = [e.data for e in events if e.kind == "state" and e.state is JobState.STARTING]
    assert starts[-1]["sizes"]["tp"] == 1 and starts[-1]["from_checkpoint"]
    assert result["sizes"]["tp"] == 1 and len(result["losses"]) == 8
    expected = undisturbed(spec(relayout=False, min_nodes=None))
    assert close(result["losses"], expected), (result["losses"], expected)
