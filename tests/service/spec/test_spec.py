"""Job spec validation: every invalid combination is refused before anything starts,
naming the field, the numbers and the fix."""

import copy

import pytest
import yaml

from service.spec.spec import load_spec, parse_spec, to_job_config


def base(**sections):
    spec = {
        "name": "t",
        "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                  "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 64},
        "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        "training": {"train_iters": 2, "global_batch_size": 16, "micro_batch_size": 2},
        "resources": {"num_nodes": 2, "gpus_per_node": 4},
    }
    for section, values in sections.items():
        spec.setdefault(section, {}).update(values)
    return spec


def refused(spec, *needles):
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return str(e.value)


def test_valid_spec_round_trips_to_config():
    job = to_job_config(parse_spec(base()))
    assert job.world_size == 8 and job.parallel.tensor_model_parallel_size == 2
    assert job.parallel.expert_tensor_parallel_size == 2  # default = tp
    assert job.model.num_query_groups == 2
    assert job.max_restarts == 3 and job.collective_timeout_s == 300.0  # fault_tolerance defaults


def test_example_spec_is_valid():
    spec = load_spec("examples/tiny-5d.yaml")
    assert spec.world_size == 8


def test_unknown_field_is_refused_with_its_path():
    refused(base(model={"hiden_size": 3}), "model.hiden_size", "Extra inputs are not permitted")
    refused({**base(), "trainning": {}}, "trainning")


@pytest.mark.parametrize("sections, needles", [
    (dict(resources={"num_nodes": 1, "gpus_per_node": 6}), ["world_size 6", "tp(2) x pp(2) x cp(1) = 4"]),
    (dict(parallel={"tensor_model_parallel_size": 8}, resources={"num_nodes": 4, "gpus_per_node": 4}),
     ["tensor_model_parallel_size 8 > resources.gpus_per_node 4"]),
    (dict(model={"num_attention_heads": 6, "num_query_groups": 3, "hidden_size": 48}, parallel={"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 1}),
     ["num_attention_heads 6 is not divisible by tensor_model_parallel_size 4"]),
    (dict(model={"num_query_groups": 1}), ["num_query_groups 1 is not divisible by tensor_model_parallel_size 2"]),
    (dict(model={"num_layers": 3}), ["num_layers 3 is not divisible by pipeline_model_parallel_size 2 = 2"]),
    (dict(parallel={"virtual_pipeline_model_parallel_size": 4}),
     ["num_layers 4 is not divisible by pipeline_model_parallel_size 2 x virtual_pipeline_model_parallel_size 4 = 8"]),
    (dict(parallel={"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": 2}),
     ["virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"]),
    (dict(model={"seq_length": 62}, parallel={"context_parallel_size": 2, "pipeline_model_parallel_size": 1}),
     ["seq_length 62", "2 x context_parallel_size 2", "= 4"]),
    (dict(model={"seq_length": 63}, parallel={"sequence_parallel": True}),
     ["seq_length 63", "tensor_model_parallel_size 2 (sequence_parallel)"]),
    (dict(model={"num_moe_experts": 3}, parallel={"expert_model_parallel_size": 2, "sequence_parallel": True}),
     ["num_moe_experts 3 is not divisible by expert_model_parallel_size 2"]),
    (dict(model={"num_moe_experts": 2, "moe_router_topk": 3}, parallel={"sequence_parallel": True}),
     ["moe_router_topk 3 > model.num_moe_experts 2"]),
    (dict(model={"num_moe_experts": 4}), ["MoE with tensor_model_parallel_size 2 needs parallel.sequence_parallel: true"]),
    (dict(parallel={"expert_model_parallel_size": 2}), ["needs model.num_moe_experts"]),
    (dict(training={"global_batch_size": 6}), ["global_batch_size 6 is not divisible by micro_batch_size 2 x dp 2 = 4"]),
    (dict(training={"global_batch_size": 12}, parallel={"virtual_pipeline_model_parallel_size": 2}),
     ["number of microbatches (3)", "multiple of pipeline_model_parallel_size 2"]),
    (dict(parallel={"order": "tp-cp-ep-dp-xx"}), ["unknown token", "xx"]),
    (dict(parallel={"order": "tp-tp-dp-pp"}), ["repeated"]),
    (dict(parallel={"order": "cp-ep-dp-pp"}), ["does not name 'tp'"]),
    (dict(resources={"min_nodes": 3}), ["resources.min_nodes 3 > resources.num_nodes 2"]),
    (dict(checkpoint={"save_interval": 0}), ["checkpoint.save_interval", "greater than or equal to 1"]),
    (dict(checkpoint={"keep_last": 0}), ["checkpoint.keep_last", "greater than or equal to 1"]),
    (dict(checkpoint={"save_every": 5}), ["checkpoint.save_every", "Extra inputs"]),
    (dict(fault_tolerance={"node_grace_s": -1}), ["fault_tolerance.node_grace_s"]),
    (dict(fault_tolerance={"collective_timeout_s": 4}), ["fault_tolerance.collective_timeout_s",
                                                         "greater than or equal to 5"]),
    (dict(fault_tolerance={"max_restarts": -1}), ["fault_tolerance.max_restarts"]),
    (dict(training={"lr": float("inf")}), ["training.lr", "finite"]),
    (dict(training={"lr": float("nan")}), ["training.lr", "finite"]),
    (dict(parallel={"tensor_model_parallel_size": "2"}), ["parallel.tensor_model_parallel_size",
                                                          "valid integer", "got '2'"]),
    (dict(parallel={"tensor_model_parallel_size": True}), ["parallel.tensor_model_parallel_size",
                                                           "valid integer", "got True"]),
    (dict(training={"train_iters": 2.0}), ["training.train_iters", "valid integer"]),
    (dict(resources={"num_nodes": 1_000_000_000}), ["world_size", "1000000000", "at most 65536"]),
    (dict(model={"hidden_size": 1048576}), ["GiB per rank", "any accelerator holds", "hidden_size"]),
    (dict(training={"data": "corpus.txt"}), ["training.data", ".npy or .bin"]),
    (dict(parallel={"cp_comm_type": "ring"}), ["parallel.cp_comm_type"]),
    (dict(parallel={"pipeline_model_parallel_size": 1, "context_parallel_size": 4, "cp_comm_type": "a2a"}),
     ["parallel.cp_comm_type a2a", "num_attention_heads 4 / tensor_model_parallel_size 2 = 2",
      "not divisible by context_parallel_size 4"]),
    (dict(parallel={"pipeline_model_parallel_size": 1, "context_parallel_size": 4, "cp_comm_type": "a2a+p2p"}),
     ["a2a+p2p needs parallel.hierarchical_context_parallel_sizes", "context_parallel_size 4, got None", "[2, 2]"]),
    (dict(parallel={"pipeline_model_parallel_size": 1, "context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                    "hierarchical_context_parallel_sizes": [4, 1]}),
     ["= 2 is not divisible by hierarchical_context_parallel_sizes[0] 4"]),
    (dict(checkpoint={"keep_best": 2}), ["checkpoint.keep_best 2 needs checkpoint.save_interval"]),
    (dict(checkpoint={"save_hf": True}), ["checkpoint.save_hf needs checkpoint.save_interval"]),
    (dict(checkpoint={"keep_best": 2, "save_interval": 4}, training={"eval_interval": 3}),
     ["training.eval_interval 3 must divide checkpoint.save_interval 4", "best_metric: lm_loss"]),
    (dict(checkpoint={"keep_best": 2, "best_metric": "accuracy"}), ["checkpoint.best_metric"]),
    (dict(parallel={"hierarchical_context_parallel_sizes": [2, 1]}),
     ["hierarchical_context_parallel_sizes [2, 1] goes with cp_comm_type a2a+p2p"]),
    (dict(parallel={"overlap_param_gather": True}), ["parallel.overlap_param_gather needs parallel.use_distributed_optimizer"]),
    (dict(training={"micro_batch_size": 0}), ["training.micro_batch_size", "greater than or equal to 1"]),
])
def test_invalid_combinations(sections, needles):
    refused(base(**copy.deepcopy(sections)), *needles)


def test_all_problems_reported_at_once():
    msg = refused(base(model={"num_layers": 3, "num_query_groups": 1}), "num_layers 3", "num_query_groups 1")
    assert msg.count(";") >= 1


def test_load_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read spec"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_spec(bad)
    good = tmp_path / "good.json"
    import json
    good.write_text(json.dumps(base()))
    assert load_spec(good).world_size == 8
    y = tmp_path / "good.yaml"
    y.write_text(yaml.safe_dump(base()))
    assert load_spec(y).name == "t"


def test_collective_timeout_reaches_the_config():
    job = to_job_config(parse_spec(base(fault_tolerance={"collective_timeout_s": 20, "max_restarts": 0})))
    assert job.collective_timeout_s == 20.0 and job.max_restarts == 0


def test_empty_or_non_mapping_spec_is_refused(tmp_path):
    for text in ("", "# nothing\n", "{}\n"):
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match="empty.yaml: the job spec is empty"):
            load_spec(path)
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping of sections"):
        load_spec(path)


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    # PyYAML reads 1e-3 as a string; with strict types that must still be a number, as in JSON.
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(base()) + "")
    spec = yaml.safe_load(path.read_text())
    spec["training"]["lr"] = "REPLACE"
    path.write_text(yaml.safe_dump(spec).replace("REPLACE", "1e-3"))
    assert load_spec(path).training.lr == 1e-3
    # and the client's commands (raytron submit / plan) read it as raytron run does
    from api.cli.client_cmds import load_spec_file

    assert load_spec_file(str(path))["training"]["lr"] == 1e-3
    path.write_text(yaml.safe_dump(spec).replace("REPLACE", ".inf"))
    with pytest.raises(ValueError, match="lr.yaml: invalid job spec: training.lr: Input should be a finite"):
        load_spec(path)


def test_checkpoint_and_elastic_fields_reach_the_job_config():
    from service.spec.spec import to_job_config

    job = to_job_config(parse_spec(base(
        checkpoint={"save_interval": 3, "dir": "/tmp/c", "keep_last": 4, "async_save": True, "load": "hf:/m"},
        resources={"num_nodes": 2, "min_nodes": 1}, fault_tolerance={"node_grace_s": 7.5})))
    c = job.checkpoint
    assert (c.save_interval, c.dir, c.keep_last, c.async_save, c.load) == (3, "/tmp/c", 4, True, "hf:/m")
    assert (job.min_nodes, job.node_grace_s, c.resume_from) == (1, 7.5, None)


def test_example_spec_saves_checkpoints():
    job = load_spec("examples/tiny-5d.yaml")
    assert job.checkpoint.save_interval and job.resources.min_nodes


def test_memory_replicas_need_another_node():
    refused(base(resources={"num_nodes": 1, "gpus_per_node": 8}, fault_tolerance={"memory_interval": 1}),
            "fault_tolerance.memory_replicas 1 needs more than 1 node(s)", "resources.num_nodes is 1")
    refused(base(fault_tolerance={"memory_interval": 1, "memory_replicas": 2}), "memory_replicas 2", "num_nodes is 2")
    job = to_job_config(parse_spec(base(fault_tolerance={"memory_interval": 2})))
    assert (job.memory_interval, job.memory_replicas, job.memory_upto) == (2, 1, None)
