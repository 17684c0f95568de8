"""``parallel.pipeline_schedule``: the default keeps today's schedule, every combination that
cannot run is refused with one line naming the fields and the fix, and the cost model's bubble
follows the schedule."""

from __future__ import annotations

import pytest

from service.spec.pipeline import bubble_fraction
from service.spec.plan import plan_job
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.parity import tiny_spec


def _spec(world: int = 2, model: dict | None = None, training: dict | None = None, **parallel):
    return tiny_spec(world=world, parallel=parallel, model=model, training=training)


@pytest.mark.parametrize("parallel,world,needle", [
    ({"pipeline_schedule": "zb-h1"}, 1,
     "parallel.pipeline_schedule zb-h1 needs parallel.pipeline_model_parallel_size > 1 (got 1): unset"),
    ({"pipeline_schedule": "zbv", "virtual_pipeline_model_parallel_size": None}, 1,
     "parallel.pipeline_schedule zbv needs parallel.pipeline_model_parallel_size > 1"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv"}, 2,
     "parallel.pipeline_schedule zbv needs parallel.virtual_pipeline_model_parallel_size 2 (got None): set vpp to 2"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4, "pipeline_schedule": "zbv"}, 2,
     "zbv needs parallel.virtual_pipeline_model_parallel_size 2 (got 4)"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1"}, 2,
     "parallel.pipeline_schedule zb-h1 runs one chunk per stage, not virtual_pipeline_model_parallel_size 2"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "pipeline_schedule": "1f1b"}, 2,
     "parallel.pipeline_schedule 1f1b runs one chunk per stage"),
    ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "interleaved"}, 2,
     "parallel.pipeline_schedule interleaved needs parallel.virtual_pipeline_model_parallel_size > 1"),
    # 8 / (1 x dp 2) = 4 microbatches < 2 x pp 2... at pp 2, dp 2 (world 4).
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "pipeline_schedule": "zbv"}, 4,
     "parallel.pipeline_schedule zbv needs at least 2 x pipeline_model_parallel_size = 4 microbatches"),
])
def test_impossible_schedules_are_refused_in_one_line(parallel, world, needle):
    with pytest.raises(ValueError) as e:
        parse_spec(tiny_spec(world=world, parallel=parallel, training={"global_batch_size": 4} if world == 4 else None))
    lines = [line for line in str(e.value).splitlines() if "pipeline_schedule" in line]
    assert len(lines) == 1 and needle in lines[0], str(e.value)


def test_zbv_with_tied_embeddings_is_refused():
    with pytest.raises(ValueError, match="model.untie_embeddings_and_output_weights: true, or use pipeline_schedule zb-h1"):
        parse_spec(_spec(model={"untie_embeddings_and_output_weights": False}, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, pipeline_schedule="zbv"))


def test_default_keeps_todays_schedule_and_reaches_the_workers():
    assert parse_spec(_spec(pipeline_model_parallel_size=2)).parallel.pipeline_schedule is None
    job = to_job_config(parse_spec(_spec(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1")))
    assert job.parallel.pipeline_schedule == "zb-h1"
    with pytest.raises(ValueError, match="pipeline_schedule"):
        parse_spec(_spec(pipeline_model_parallel_size=2, pipeline_schedule="gpipe"))


def test_bubble_by_schedule():
    assert bubble_fraction(None, 4, None, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("interleaved", 4, 2, 8) == pytest.approx(3 / 16)
    assert bubble_fraction("zb-h1", 4, None, 8) == pytest.approx(3 / 24)
    assert bubble_fraction("zbv", 4, 2, 8) == pytest.approx(3 / 48)
    assert bubble_fraction("zb-h1", 1, None, 8) == 0
    # ... and the plan's predicted step: ZB-H1's bubble a third of 1F1B's, on accelerators.
    gpu = {"resources": {"num_nodes": 1, "gpus_per_node": 2, "gpu_type": "H100"}}
    one, zb = ({**_spec(pipeline_model_parallel_size=2, **extra), **gpu} for extra in ({}, {"pipeline_schedule": "zb-h1"}))
    b1, bz = (plan_job(parse_spec(s))["cost"]["step_seconds"]["bubble"] for s in (one, zb))
    assert bz == pytest.approx(b1 / 3)


def test_plan_places_the_v():
    """ZBV: the output layer counts on stage 0 with the embedding, and the turn at the last stage
    sends nothing (2 pp - 2 boundaries on the wire, not 2 pp - 1)."""
    from service.spec.plan import count_traffic
    from service.spec.shapes import Shapes, rank_parameters
    from service.spec.spec import grid_of

    par = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    inter, zbv = (parse_spec(_spec(**par, **extra)) for extra in ({}, {"pipeline_schedule": "zbv"}))
    counts = {}
    for name, spec in (("inter", inter), ("zbv", zbv)):
        grid, s = grid_of(spec), Shapes.of(spec)
        counts[name] = [rank_parameters(s, grid, r)["dense"] for r in range(2)]
        counts[name + "-pp"] = count_traffic(s, spec, grid, [0, 0]).totals["pp"]["in_node"]
    assert sum(counts["inter"]) == sum(counts["zbv"])
    assert counts["zbv"][0] > counts["zbv"][1] and counts["inter"][0] < counts["inter"][1]
    assert counts["zbv-pp"] * 3 == counts["inter-pp"] * 2


def test_zbv_with_mtp_is_refused():
    with pytest.raises(ValueError, match=r"zbv puts the MTP modules \(model.mtp_num_layers 1\)"):
        parse_spec(_spec(model={"mtp_num_layers": 1}, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, pipeline_schedule="zbv"))
