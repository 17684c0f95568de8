"""``parallel: auto``: the search over valid layouts, its spelling and validation, ``raytron plan --auto``,
and the real-size examples (Llama-3-8B, Mixtral-8x7B-shaped) on 2 x 8 x 80 GB."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import yaml

from api.cli.main import main as cli_main
from api.cli.tables import print_job_plan
from service.spec.check import check_spec
from service.spec.placement import check_tp_in_node, plan_placement
from service.spec.plan import plan_job
from service.spec.spec import grid_of, parse_spec, search_layouts
from workers.grid import ParallelGrid

from tests.helpers.paths import EXAMPLES
KEYS = {"sizes", "order", "micro_batch_size", "use_distributed_optimizer", "recompute_granularity",
        "predicted_step_s", "peak_bytes_per_rank"}


def small(parallel="auto", **resources):
    return {"name": "auto", "model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
                                      "num_query_groups": 2, "ffn_hidden_size": 128, "vocab_size": 256,
                                      "seq_length": 64, "recompute_granularity": "auto"},
            "parallel": parallel, "training": {"global_batch_size": 16, "micro_batch_size": "auto"},
            "resources": {"num_nodes": 2, "gpus_per_node": 4, **resources}}


def plan_auto_json(path, capsys) -> dict:
    assert cli_main(["plan", "--auto", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("example", ["llama3-8b-auto.yaml", "mixtral-8x7b-auto.yaml"])
def test_examples_choose_a_layout_that_fits_with_tp_in_a_node(example, capsys):
    found = plan_auto_json(EXAMPLES / example, capsys)
    assert found["chosen"] == 0 and found["candidates"]
    steps = [c["predicted_step_s"] for c in found["candidates"]]
    assert steps == sorted(steps)
    best = found["candidates"][0]
    assert KEYS <= set(best) and set(best["sizes"]) == {"tp", "pp", "vpp", "cp", "ep", "dp"}
    assert best["peak_bytes_per_rank"] <= 0.85 * 80e9
    spec = parse_spec(yaml.safe_load((EXAMPLES / example).read_text()))  # the job that would run
    s = best["sizes"]
    p = spec.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
            p.context_parallel_size, p.expert_model_parallel_size) == (s["tp"], s["pp"], s["vpp"], s["cp"], s["ep"])
    assert spec.training.micro_batch_size == best["micro_batch_size"]
    assert p.use_distributed_optimizer == best["use_distributed_optimizer"]
    assert spec.model.recompute_granularity == best["recompute_granularity"]
    grid = grid_of(spec)
    assert grid.dp == s["dp"]
    placement = plan_placement(grid, 8, 2)
    assert check_tp_in_node(grid, [pl.node for pl in placement]) == []
    for c in found["candidates"]:
        assert c["sizes"]["tp"] <= 8 and c["peak_bytes_per_rank"] <= 0.85 * 80e9


def test_a_fixed_field_stays_fixed_and_the_rest_is_chosen():
    found = search_layouts(small({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": "auto",
                                  "sequence_parallel": True}))
    assert found["candidates"] and all(c["sizes"]["tp"] == 2 and c["sequence_parallel"]
                                       for c in found["candidates"])
    assert all(c["sizes"]["cp"] == 1 and c["sizes"]["ep"] == 1 for c in found["candidates"])
    assert "parallel.pipeline_model_parallel_size" in found["open"]
    assert "parallel.context_parallel_size" not in found["open"]


def test_every_candidate_is_a_valid_spec_and_the_spec_resolves_to_the_first():
    data = small()
    found = search_layouts(data)
    for c in found["candidates"]:
        parse_spec(c["data"])  # raises if the search let an invalid layout through
        assert c["sizes"]["tp"] <= 4
    spec = parse_spec(data)
    assert spec.parallel.tensor_model_parallel_size == found["candidates"][0]["sizes"]["tp"]
    assert spec.model_dump()["parallel"]["tensor_model_parallel_size"] != "auto"  # what is stored is concrete
    check = check_spec(data)  # the API's path (422 / submit) resolves the same way
    assert not check.problems and check.spec == spec


@pytest.mark.parametrize("parallel, needle", [
    ("manual", "parallel"), ({"tensor_model_parallel_size": "Auto"}, "parallel.tensor_model_parallel_size"),
    ({"tensor_model_parallel_size": 0}, "parallel.tensor_model_parallel_size"),
    ({"sequence_parallel": "yes"}, "parallel.sequence_parallel"),
    ({"expert_tensor_parallel_size": "auto"}, "parallel.expert_tensor_parallel_size"),
    ({"tensor_model_parallel_size": 3, "pipeline_model_parallel_size": "auto"}, "no valid layout"),
])
def test_bad_auto_spellings_are_refused(parallel, needle):
    with pytest.raises(ValueError) as e:
        parse_spec(small(parallel))
    assert needle in str(e.value)
    assert check_spec(small(parallel)).problems


def test_no_layout_fits_names_the_memory_and_the_fix(tmp_path, capsys):
    data = small(gpu_memory_gb=0.0001)
    with pytest.raises(ValueError, match="no layout that fits .* add nodes"):
        parse_spec(data)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli_main(["plan", "--auto", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no layout that fits" in err and len(err.strip().splitlines()) == 1


def test_plan_auto_table_and_a_concrete_spec(tmp_path, capsys):
    """A spec with nothing open is searched with its parallel section open; the table marks the choice."""
    data = small({"tensor_model_parallel_size": 2, "sequence_parallel": True})
    data["model"]["recompute_granularity"] = None
    data["training"]["micro_batch_size"] = 1
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli_main(["plan", "--auto", str(path)]) == 0
    out = capsys.readouterr().out
    assert " 0*" in out and "peak GB" in out and "bubble s" in out and "x-node GB" in out
    buf = io.StringIO()
    print_job_plan(plan_job(parse_spec(data)), buf)  # plain `raytron plan` prints the cost model's lines
    assert "cost model (simulated-cpu)" in buf.getvalue() and "step" in buf.getvalue()
    assert ParallelGrid(8, tp=2).dp == 4


def test_memory_decides_when_it_is_short(capsys):
    """With 40 GB per GPU (no gpu_type), every candidate fits 34 GB: the distributed optimizer,
    recompute or more model parallelism are chosen where 80 GB needed none."""
    data = yaml.safe_load((EXAMPLES / "llama3-8b-auto.yaml").read_text())
    data["resources"] = {"num_nodes": 2, "gpus_per_node": 8, "gpu_memory_gb": 40, "gpu_peak_tflops": 989,
                         "intra_node_bandwidth_gbps": 450, "inter_node_bandwidth_gbps": 50}
    found = search_layouts(data)
    assert all(c["peak_bytes_per_rank"] <= 0.85 * 40e9 for c in found["candidates"])
    best = found["candidates"][0]
    assert best["use_distributed_optimizer"] or best["recompute_granularity"] or best["sizes"]["dp"] < 4
    roomy = search_layouts(yaml.safe_load((EXAMPLES / "llama3-8b-auto.yaml").read_text()))
    assert max(c["peak_bytes_per_rank"] for c in roomy["candidates"]) > 0.85 * 40e9


def test_a_bad_cluster_is_named_once_for_an_auto_spec():
    problems = check_spec(small(gpu_type="H100", gpu_memory_gb=40)).problems
    assert [p["field"] for p in problems] == ["resources.gpu_memory_gb"]


def test_a_world_too_large_to_search_is_refused_before_any_search():
    """A spec is resolved where it is read (the REST server too), and the search grows with the
    world: past AUTO_MAX_WORLD_SIZE ranks it is refused at once, naming the numbers and the fix."""
    from service.spec.auto import AUTO_MAX_WORLD_SIZE

    problems = check_spec(small(num_nodes=AUTO_MAX_WORLD_SIZE // 4 + 1, gpus_per_node=4)).problems
    assert len(problems) == 1 and f"at most {AUTO_MAX_WORLD_SIZE} ranks" in problems[0]["message"], problems
    assert problems[0]["field"] == "resources.num_nodes"
    assert check_spec(small(num_nodes=2, gpus_per_node=4)).problems == []
