"""`service.spec.plan`: parameter counts against the real model's numel, memory and traffic by hand."""

from __future__ import annotations

import pytest

from service.spec import cost
from service.spec.plan import BYTES, plan_job
from service.spec.shapes import Shapes, rank_parameters
from service.spec.spec import parse_spec, to_job_config
from workers.grid import ParallelGrid

QWEN = {"add_qkv_bias": True, "qk_layernorm": True, "kv_channels": 16, "untie_embeddings_and_output_weights": False}


def spec_of(*, world=1, nodes=1, moe=False, parallel=None, training=None, vocab=250, model=None):
    return parse_spec({
        "name": "plan",
        "model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                  "ffn_hidden_size": 64, "vocab_size": vocab, "seq_length": 16,
                  **({"num_moe_experts": 4, "moe_router_topk": 2} if moe else {}), **(model or {})},
        "parallel": parallel or {},
        "training": {"global_batch_size": 8, "micro_batch_size": 1, **(training or {})},
        "resources": {"num_nodes": nodes, "gpus_per_node": world // nodes}})


@pytest.mark.parametrize("kind", [False, True, "qwen", "deepseek-v3", "mtp", "qwen-mtp", "deepseek-v3-mtp"])
@pytest.mark.parametrize("stage", [None, 0, 1])
def test_parameter_counts_match_the_real_model(kind, stage):
    """Single process: the whole model, or the layers of one of two pipeline stages ("qwen":
    QKV bias, q/k norms, head dim 16, tied output: one table at pp 1, a copy on the last stage;
    "deepseek-v3": expert ffn, shared experts and a dense first layer, tests.helpers.parity.V3_MODEL;
    "-mtp": two MTP modules on the last stage, with the embedding's copy there when untied)."""
    import torch

    from tests.helpers.parity import V3_MODEL
    from workers.model.decoder import ModelChunk, ShardContext

    mtp = {"mtp_num_layers": 2}
    model = {"qwen": QWEN, "deepseek-v3": V3_MODEL, "mtp": mtp, "qwen-mtp": {**QWEN, **mtp},
             "deepseek-v3-mtp": {**V3_MODEL, **mtp}}.get(kind)
    spec = spec_of(moe=kind is True, model=model)
    job = to_job_config(spec)
    layers = list(range(4)) if stage is None else [2 * stage, 2 * stage + 1]
    chunk = ModelChunk(job.model, ShardContext(seed=1), layers, pre_process=stage in (None, 0),
                       post_process=stage in (None, 1), positions=torch.arange(16))
    numel = sum(p.numel() for p in chunk.parameters())
    if stage is None:
        assert plan_job(spec)["model_parameters"] == numel
    else:
        grid = ParallelGrid(2, pp=2)
        p = rank_parameters(Shapes.of(spec), grid, grid.rank_of(pp=stage))
        assert p["dense"] + p["expert"] == numel  # mutation: the output layer on stage 0 -> off by vocab x hidden


def _shard_numel(rank, world_size, job):
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world_size)
    return sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())


@pytest.mark.parametrize("moe,parallel", [(False, {"tensor_model_parallel_size": 2}),
                                          (True, {"expert_model_parallel_size": 2})])
@pytest.mark.slow
def test_sharded_counts_match_two_real_ranks(moe, parallel):
    from tests.helpers.ranks import run_ranks

    spec = spec_of(world=2, moe=moe, parallel=parallel, vocab=251)  # 251: padded to 252 under tp 2
    per_rank = run_ranks(_shard_numel, 2, args=(to_job_config(spec),), timeout_s=300)
    planned = [m["parameters"] for m in plan_job(spec)["memory"]]
    assert planned == per_rank  # mutation: experts not divided by ep -> the MoE case fails


def test_memory_with_and_without_the_distributed_optimizer():
    spec = spec_of(world=4, parallel={"use_distributed_optimizer": True})
    mem = plan_job(spec)["memory"]
    n = mem[0]["parameters"]
    assert mem[0]["param_bytes"] == mem[0]["grad_bytes"] == BYTES * n
    assert mem[0]["optimizer_bytes"] == 2 * BYTES * n and mem[0]["total_bytes"] == 16 * n
    # fp32 ZeRO-1: 2 moments over dp 4 (the main params are the params' own slices), plus gloo's staging
    assert mem[0]["optimizer_bytes_distributed"] == round(8 * n / 4)
    bucket = min(cost.BUCKET_ELEMENTS, n)
    scratch = bucket * BYTES + cost.SCATTERS_IN_FLIGHT * bucket * 4
    assert mem[0]["total_bytes_distributed"] == round(8 * n + 8 * n / 4 + scratch)


def test_the_plan_gives_one_memory_answer_per_rank():
    """A bf16 job's per-rank memory is the cost model's accounting (Megatron's 18 bytes per parameter,
    6 + 12/n with the distributed optimizer), the same bytes as ``cost.state_bytes`` of its busiest rank."""
    for distributed in (False, True):
        spec = spec_of(world=4, parallel={"use_distributed_optimizer": distributed})
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"bf16": True})})
        plan = plan_job(spec)
        key = "total_bytes_distributed" if distributed else "total_bytes"
        assert max(m[key] for m in plan["memory"]) == round(plan["cost"]["state_bytes"]["total"])
        n = plan["memory"][0]["parameters"]
        assert plan["memory"][0]["param_bytes"] == 2 * n and plan["memory"][0]["optimizer_bytes"] == 12 * n


@pytest.mark.parametrize("world,parallel", [
    (2, {"context_parallel_size": 2}),  # 2 K/V heads split over cp 2
    (4, {"context_parallel_size": 4}),  # K/V repeated to one per query head
    (4, {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    (4, {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [2, 2]}),
    (8, {"context_parallel_size": 8, "cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [4, 2]}),
], ids=["cp2", "cp4", "cp2-tp2-sp", "cp4-2x2", "cp8-4x2"])
def test_a2a_context_traffic_is_the_measured_minimum(world, parallel):
    """The plan's all-to-all CP bytes, summed over ranks, equal the minimum the communication benchmark
    derives on its own (and measures: tests/test_bench_smoke.py)."""
    from bench.comm_bench import analytic_bytes

    spec = spec_of(world=world, parallel={"cp_comm_type": "a2a", **parallel})
    job = to_job_config(spec)
    assert plan_job(spec)["traffic"]["cp"]["in_node"] == sum(analytic_bytes(job, r)["cp"] for r in range(world)) > 0


def test_traffic_splits_in_node_and_cross_node_by_the_placement():
    # 2 nodes x 2 GPUs, tp 2 inside each node, dp 2 across the nodes.
    spec = spec_of(world=4, nodes=2, parallel={"tensor_model_parallel_size": 2})
    plan = plan_job(spec)
    traffic = plan["traffic"]
    assert [r["node"] for r in plan["placement"]] == [0, 0, 1, 1]
    dense = plan["memory"][0]["dense_parameters"] * BYTES
    # dp groups [0,2] and [1,3]: a ring of 2 in which each rank sends 2 x (1/2) x its gradients
    assert traffic["dp"] == {"in_node": 0, "cross_node": 4 * dense}
    mbs, layers, act = 8 // (1 * 2), 4, 16 * 1 * 32 * BYTES
    # 4 ranks, each per microbatch and layer 4 all-reduces of 2 x (1/2) x the activation
    assert traffic["tp"] == {"in_node": 4 * mbs * layers * 4 * act, "cross_node": 0}
    assert traffic["pp"] == traffic["cp"] == traffic["ep"] == {"in_node": 0, "cross_node": 0}
    # tp 2 x pp 2 on 2 nodes: the pipeline crosses the nodes, tp never does
    swapped = plan_job(spec_of(world=4, nodes=2, parallel={"tensor_model_parallel_size": 2,
                                                            "pipeline_model_parallel_size": 2}, training={}))
    assert swapped["traffic"]["pp"]["cross_node"] > 0 and swapped["traffic"]["tp"]["cross_node"] == 0


def test_pipeline_traffic_counts_each_boundary_both_ways():
    spec = spec_of(world=2, parallel={"pipeline_model_parallel_size": 2})
    t = plan_job(spec)["traffic"]["pp"]
    mbs, act = 8, 16 * 1 * 32 * BYTES
    assert t == {"in_node": 2 * mbs * act, "cross_node": 0}
    vpp = plan_job(spec_of(world=2, parallel={"pipeline_model_parallel_size": 2,
                                               "virtual_pipeline_model_parallel_size": 2}))["traffic"]["pp"]
    assert vpp["in_node"] == 3 * t["in_node"]  # 4 virtual stages: 3 boundaries instead of 1
