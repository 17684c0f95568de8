"""`service.spec.cost`: per-rank bytes against Megatron-LM's own formulas, the cluster figures,
and the step-time parts.

The outside reference is a transcription of ``compute_weight_and_optimizer_memory`` and
``compute_activation_memory`` from megatron/training/theoretical_memory_usage.py of NVIDIA/Megatron-LM
(commit 00caa53af30912914981c86f39db123961678bbd), the branches this model takes (no MLA, no MTP,
no shared experts, every layer MoE when experts are set), kept line for line otherwise.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from service.spec import cost
from service.spec.plan import estimate
from service.spec.shapes import Shapes, rank_parameters
from service.spec.spec import grid_of, parse_spec
from workers.grid import ParallelGrid


# ---------------------------------------------------------------- Megatron's formulas (transcribed)
def megatron_weight_and_optimizer_memory(args):
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = query_projection_size / args.hidden_size
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    num_experts = 1 if args.num_experts is None else args.num_experts
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1
    shared_expert_ffn_hidden_size = 0
    if args.num_experts is not None:
        moe_layer_pattern = [1 if (i % args.moe_layer_freq == 0) else 0 for i in range(args.num_layers)]
        num_dense_layers = args.num_layers - sum(moe_layer_pattern)
        num_moe_layers = sum(moe_layer_pattern)
        moe_ffn_hidden_size = args.moe_ffn_hidden_size
    else:
        num_dense_layers = args.num_layers
        num_moe_layers = 0
        moe_ffn_hidden_size = 0
    norm_size = 1 if args.normalization == "RMSNorm" else 2
    self_attn_term = (2 * args.hidden_size * args.hidden_size * (
        (1 + (args.num_query_groups / args.num_attention_heads)) * query_projection_to_hidden_size_ratio))
    num_parameters_in_transformer_layer_dense = (
        2 * args.hidden_size * ((args.ffn_hidden_size * gated_linear_multiplier) + norm_size) + self_attn_term)
    num_parameters_in_transformer_layer_moe = (
        2 * args.hidden_size * (+(moe_ffn_hidden_size * num_experts * gated_linear_multiplier)
                                + (shared_expert_ffn_hidden_size * gated_linear_multiplier) + norm_size)
        + self_attn_term)
    embedding_size = args.hidden_size * args.padded_vocab_size
    final_layernorm = norm_size * args.hidden_size
    num_parameters_in_transformer_block = (
        num_parameters_in_transformer_layer_dense * num_dense_layers
        + num_parameters_in_transformer_layer_moe * num_moe_layers + final_layernorm)
    num_parameters_in_mtp_block = 0
    num_parameters_on_most_loaded_model_shard = (
        (num_parameters_in_transformer_block / args.pipeline_model_parallel_size)
        + num_parameters_in_mtp_block + embedding_size) / args.tensor_model_parallel_size
    if args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size == 1:
        num_parameters_on_most_loaded_model_shard += embedding_size / args.tensor_model_parallel_size
    num_bytes_per_parameter = 18 if not args.use_distributed_optimizer else 6 + (12 / args.data_parallel_size)
    return num_parameters_on_most_loaded_model_shard * num_bytes_per_parameter


def megatron_activation_memory(args, num_microbatches):
    activation_memory = (args.seq_length * args.micro_batch_size * args.hidden_size) * (
        18 + (4 * (args.ffn_hidden_size / args.hidden_size)))
    activation_memory *= args.num_layers
    activation_memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    activation_memory += (args.seq_length * args.micro_batch_size * args.hidden_size
                          * args.pipeline_model_parallel_size)
    if args.virtual_pipeline_model_parallel_size is not None:
        interleaved_schedule_memory_penalty = 1 + ((args.pipeline_model_parallel_size - 1) / (
            args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size))
        activation_memory *= interleaved_schedule_memory_penalty
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        activation_memory += (args.seq_length * args.micro_batch_size * args.hidden_size * 4
                              * (1 + (args.padded_vocab_size / args.hidden_size)))
    return activation_memory / args.tensor_model_parallel_size


# ---------------------------------------------------------------- the configurations
LLAMA3_8B = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
             "ffn_hidden_size": 14336, "vocab_size": 128256, "seq_length": 8192}
MIXTRAL_8X7B = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
                "ffn_hidden_size": 14336, "vocab_size": 32000, "seq_length": 4096, "num_moe_experts": 8,
                "moe_router_topk": 2}


def spec_of(model, *, tp=1, pp=1, dist=False, mbs=1, gbs=64, world=8, sp=None, recompute=None, vpp=None):
    sp = tp > 1 if sp is None else sp
    return parse_spec({
        "name": "cost", "model": {**model, **({"recompute_granularity": "selective"} if recompute else {})},
        "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "virtual_pipeline_model_parallel_size": vpp, "sequence_parallel": sp,
                     "use_distributed_optimizer": dist},
        "training": {"global_batch_size": gbs, "micro_batch_size": mbs, "bf16": True},
        "resources": {"num_nodes": world // 8 or 1, "gpus_per_node": min(8, world), "gpu_type": "H100"}})


def megatron_args(spec):
    m, p, t = spec.model, spec.parallel, spec.training
    grid = grid_of(spec)
    tp = p.tensor_model_parallel_size
    return SimpleNamespace(
        kv_channels=m.hidden_size // m.num_attention_heads, num_attention_heads=m.num_attention_heads,
        hidden_size=m.hidden_size, group_query_attention=True, num_query_groups=m.num_query_groups,
        num_experts=m.num_moe_experts, swiglu=True, moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
        moe_ffn_hidden_size=m.ffn_hidden_size, num_layers=m.num_layers, ffn_hidden_size=m.ffn_hidden_size,
        mtp_num_layers=None, normalization="RMSNorm", multi_latent_attention=False,
        padded_vocab_size=math.ceil(m.vocab_size / (128 * tp)) * 128 * tp,
        untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=grid.pp,
        tensor_model_parallel_size=tp, use_distributed_optimizer=p.use_distributed_optimizer,
        data_parallel_size=grid.dp, seq_length=m.seq_length, micro_batch_size=t.micro_batch_size,
        virtual_pipeline_model_parallel_size=grid.vpp)


def ours(spec) -> dict:
    grid = grid_of(spec)
    return estimate(spec, grid, [r // spec.resources.gpus_per_node for r in range(grid.world_size)])


CASES = [("llama3-8b tp1 dp8", LLAMA3_8B, 1, 1), ("llama3-8b tp2 pp2", LLAMA3_8B, 2, 2),
         ("mixtral-8x7b tp2 pp2 (GQA+MoE)", MIXTRAL_8X7B, 2, 2)]


@pytest.mark.parametrize("dist", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_state_bytes_match_megatron(case, dist):
    """Weights + gradients + optimizer state of the most loaded rank, bf16 mixed precision, within 1%."""
    _, model, tp, pp = case
    spec = spec_of(model, tp=tp, pp=pp, dist=dist)
    state = ours(spec)["state_bytes"]
    # The distributed optimizer's all-gather / gloo staging scratch apart, Megatron's count.
    mine = state["total"] - state["scratch"]
    theirs = megatron_weight_and_optimizer_memory(megatron_args(spec))
    assert mine == pytest.approx(theirs, rel=0.01), (mine / 2**30, theirs / 2**30)


def test_distributed_optimizer_bytes_per_parameter():
    """18 bytes per parameter; 6 + 12/n sharded; fp32 16 and 8 + 8/n (the moments' shard: the
    fp32 params are their own main params; the reduce-scatter is in place), the distributed
    optimizer's scratch apart."""
    def total(*args, **kw):
        st = cost.state_bytes(*args, **kw)
        return st["total"] - st["scratch"]

    assert total(100, 0, 4, 1, mixed=True, distributed=False) == 1800
    assert total(100, 0, 4, 1, mixed=True, distributed=True) == 600 + 300
    assert total(100, 0, 4, 1, mixed=False, distributed=False) == 1600
    assert total(100, 0, 4, 1, mixed=False, distributed=True) == 800 + 200
    assert cost.state_bytes(0, 100, 4, 2, mixed=True, distributed=True)["optimizer"] == 600  # expert dp shards
    # scratch: gloo's staging of one all-gather bucket in the params' dtype and of two fp32 buckets
    assert cost.state_bytes(100, 0, 4, 1, mixed=False, distributed=True)["scratch"] == 100 * 4 + 2 * 100 * 4
    assert cost.state_bytes(4e6, 0, 4, 1, mixed=True, distributed=True)["scratch"] == 1e6 * 2 + 2 * 1e6 * 4
    assert cost.state_bytes(100, 0, 4, 1, mixed=False, distributed=False)["scratch"] == 0


def activation_rows():
    """(case, ours, Megatron's) activation bytes: SP + selective recompute, as Megatron's formula assumes."""
    rows = []
    for name, model, tp, pp in [("llama3-8b tp1 pp1 mbs1", LLAMA3_8B, 1, 1), ("llama3-8b tp2 pp2 mbs1", LLAMA3_8B, 2, 2),
                                ("llama3-8b tp8 pp1 mbs1", LLAMA3_8B, 8, 1)]:
        spec = spec_of(model, tp=tp, pp=pp, recompute=True)
        act = ours(spec)["activation_bytes"]
        # Megatron's formula leaves out the logits' gradient (live, with every activation, when
        # backward starts: part of this trainer's peak); the rest is compared
        rows.append((name, act["total"] - act["logits_grad"],
                     megatron_activation_memory(megatron_args(spec), num_microbatches=64 // grid_of(spec).dp)))
    return rows


def test_activation_bytes_beside_megatron():
    """Megatron's per layer is 18 + 4 f/h s b h (Korthikanti's 34 at f = 4h, GeLU); ours is
    12 + 4 g/a + 6 f/h + 4 a/h: no dropout masks (-3), GQA's smaller K/V (-3), flash attention's
    log-sum-exp (+4 a/h), SwiGLU's gate, up and product (6 f/h, +2 f/h): about 6% more for Llama-3-8B.
    Close, and the same scaling with TP."""
    rows = activation_rows()
    for name, mine, theirs in rows:
        assert 0.9 < mine / theirs < 1.15, (name, mine / 2**30, theirs / 2**30)
    assert rows[0][1] / rows[2][1] == pytest.approx(rows[0][2] / rows[2][2], rel=0.2)


def test_activations_fall_with_sp_cp_and_recompute():
    base = ours(spec_of(LLAMA3_8B, tp=2, sp=False))["activation_bytes"]["total"]
    assert ours(spec_of(LLAMA3_8B, tp=2, sp=True))["activation_bytes"]["total"] < base
    full = parse_spec({**spec_of(LLAMA3_8B, tp=2).model_dump(),
                       "model": {**LLAMA3_8B, "recompute_granularity": "full", "recompute_method": "uniform",
                                 "recompute_num_layers": 1}})
    assert ours(full)["activation_bytes"]["total"] < 0.3 * base
    assert ours(full)["step_seconds"]["recompute"] > 0


def test_cluster_figures_and_their_effect():
    h100 = cost.cluster_of(spec_of(LLAMA3_8B).resources)
    assert (h100.memory_bytes, h100.peak_flops, h100.intra_bytes_per_s, h100.inter_bytes_per_s) == (
        80e9, 989e12, 450e9, 50e9)
    data = spec_of(LLAMA3_8B).model_dump()
    data["resources"] = {"num_nodes": 1, "gpus_per_node": 8, "gpu_memory_gb": 40, "gpu_peak_tflops": 100,
                         "intra_node_bandwidth_gbps": 100, "inter_node_bandwidth_gbps": 10}
    slow = ours(parse_spec(data))
    assert slow["cluster"]["memory_gb"] == 40 and not slow["fits"]
    assert slow["predicted_step_s"] > ours(spec_of(LLAMA3_8B))["predicted_step_s"] * 5
    data["resources"] = {"num_nodes": 1, "gpus_per_node": 8}
    assert ours(parse_spec(data))["cluster"]["name"] == "simulated-cpu"


@pytest.mark.parametrize("resources, needle", [
    ({"gpu_type": "H100", "gpu_memory_gb": 40}, "resources.gpu_memory_gb is given with resources.gpu_type H100"),
    ({"gpu_type": "A100", "gpu_peak_tflops": 100}, "resources.gpu_peak_tflops is given with"),
    ({"intra_node_bandwidth_gbps": 10, "inter_node_bandwidth_gbps": 50}, "inter_node_bandwidth_gbps 50 is above"),
    ({"gpu_memory_gb": 0}, "resources.gpu_memory_gb"), ({"gpu_memory_gb": -1}, "greater than 0"),
    ({"gpu_type": "V100"}, "resources.gpu_type"), ({"gpu_peak_tflops": "fast"}, "resources.gpu_peak_tflops"),
    ({"inter_node_bandwidth_gbps": 1e9}, "less than or equal to 100000"),
])
def test_bad_cluster_descriptions_are_refused(resources, needle):
    with pytest.raises(ValueError) as e:
        parse_spec({"resources": {"num_nodes": 1, "gpus_per_node": 1, **resources}})
    assert needle in str(e.value)


def test_step_time_parts():
    """Bubble (p-1)/(v m) of the stage's work; TP costs nothing at tp 1; cross-node DP at the IB rate."""
    spec = spec_of(LLAMA3_8B, tp=1, pp=2, world=16, gbs=64)
    step = ours(spec)["step_seconds"]
    work = step["compute"] + step["recompute"] + step["tp"] + step["cp"] + step["ep"] + step["pp"]
    m = 64 // (1 * grid_of(spec).dp)
    assert step["bubble"] == pytest.approx(work * (2 - 1) / m)
    assert step["tp"] == 0
    flops = cost.megatron_flops(Shapes.of(spec), 64)
    assert step["compute"] == pytest.approx(flops / 16 / (989e12 * cost.EFFICIENCY))
    # default order: dp 8 inside a node (NVLink); with pp inside the node, every dp ring crosses nodes and
    # runs at the InfiniBand rate: 450 / 50 = 9 times slower
    data = spec.model_dump()
    data["parallel"]["order"] = "tp-cp-ep-pp-dp"
    across = ours(parse_spec(data))["step_seconds"]
    assert across["dp"] / step["dp"] == pytest.approx(450 / 50, rel=0.01)
    assert ParallelGrid(16, pp=2, order="tp-cp-ep-pp-dp").groups("dp")[0] == [0, 2, 4, 6, 8, 10, 12, 14]


def test_megatron_flops_with_deepseek_v3_routing():
    """Megatron's per-layer MLP average: 1 dense layer (ffn 64) and 3 MoE layers of top-2 x expert ffn
    48 + shared 32 (tests.helpers.parity.V3_MODEL)."""
    from tests.helpers.parity import V3_MODEL, tiny_spec

    s = Shapes.of(parse_spec(tiny_spec(model=V3_MODEL)))
    h, L, seq = 32, 4, 16
    attention = 1 + 2 / 4 + seq / h / 2
    mlp = (64 + 3 * (2 * 48 + 32)) / L / h * 1.5
    want = 12 * 8 * seq * L * h * h * (attention + mlp + 256 / (2 * L * h))
    assert cost.megatron_flops(s, 8) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------- the simulated CPU cluster (shared cores)
SMALL = {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
         "ffn_hidden_size": 1024, "vocab_size": 2048, "seq_length": 256}


def cpu_spec(parallel: dict, **resources):
    """bench/auto_layout_bench.py's timed model on the 2 x 4 simulated CPU cluster."""
    return parse_spec({"model": SMALL, "parallel": parallel, "training": {"global_batch_size": 16,
                                                                          "micro_batch_size": 1},
                       "resources": {"num_nodes": 2, "gpus_per_node": 4, **resources}})


def test_the_simulated_cpu_cluster_is_the_default_and_shares_its_cores():
    default = cost.cluster_of(cpu_spec({}).resources)
    assert default == cost.cluster_of(cpu_spec({}, gpu_type="cpu").resources)
    assert default.name == "simulated-cpu" and default.cores == cost.CPU_FIGURES["cores"] > 0
    assert default.peak_flops == cost.CPU_FIGURES["peak_tflops"] * 1e12
    assert default.hop_latency_s and all(t > 0 for _, t in default.hop_latency_s) and default.memory_bytes_per_s > 0
    assert cost.cluster_of(cpu_spec({}, intra_node_bandwidth_gbps=1).resources).intra_bytes_per_s == 1e9
    # a peak without a type describes an accelerator of one's own: one per rank, the GPU model
    assert cost.cluster_of(cpu_spec({}, gpu_peak_tflops=100).resources).cores == 0
    assert cost.cluster_of(spec_of(LLAMA3_8B).resources).cores == 0
    with pytest.raises(ValueError, match="resources.gpu_peak_tflops is given with resources.gpu_type cpu"):
        cpu_spec({}, gpu_type="cpu", gpu_peak_tflops=1)


def test_on_shared_cores_the_machine_does_every_ranks_work_and_a_bubble_is_not_idle():
    """Compute = the whole batch's FLOPs at the machine's rate, the same in every layout (TP and PP
    split the work, they do not shrink it); no bubble; a pp 8 pipeline costs its sends only."""
    cl = cost.cluster_of(cpu_spec({}).resources)
    s = Shapes.of(cpu_spec({}))
    steps = {name: ours(cpu_spec(par))["step_seconds"] for name, par in
             {"dp8": {}, "pp8": {"pipeline_model_parallel_size": 8},
              "tp2 pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}.items()}
    for step in steps.values():
        assert step["compute"] == pytest.approx(cost.megatron_flops(s, 16) / cl.peak_flops)
        assert step["bubble"] == 0
        assert step["total"] == pytest.approx(step["compute"] + step["recompute"] + step["tp"] + step["cp"]
                                              + step["ep"] + step["pp"] + step["dp_exposed"] + step["optimizer"])
    pp8 = steps["pp8"]
    assert pp8["dp"] == 0 and pp8["tp"] == 0 and pp8["pp"] > 0
    # one single-threaded rank uses one of the machine's cores
    one = parse_spec({"model": SMALL, "training": {"global_batch_size": 16, "micro_batch_size": 1},
                      "resources": {"num_nodes": 1, "gpus_per_node": 1}})
    assert ours(one)["step_seconds"]["compute"] == pytest.approx(
        cost.megatron_flops(s, 16) / (cl.peak_flops / cost.CPU_FIGURES["cores"]))
    # on 8 dedicated devices the same pipeline idles (p-1)/m of the work
    gpus = ours(cpu_spec({"pipeline_model_parallel_size": 8}, gpu_peak_tflops=0.1, intra_node_bandwidth_gbps=2,
                         inter_node_bandwidth_gbps=2))["step_seconds"]
    assert gpus["bubble"] > 0.4 * gpus["compute"]


def test_on_shared_cores_tp_pays_a_latency_per_message_and_dp_its_bytes():
    """The ranking the measured CPU cluster shows (README): TP's many small collectives cost their
    latency, so tp 4 ranks below dp 8; DP's gradient all-reduce is not hidden behind backward."""
    from service.spec.cost_cpu import hop_latency

    cl = cost.cluster_of(cpu_spec({}).resources)
    tp4_spec = cpu_spec({"tensor_model_parallel_size": 4, "sequence_parallel": True})
    dp8 = ours(cpu_spec({}))["step_seconds"]
    tp4 = ours(tp4_spec)["step_seconds"]
    pp8 = ours(cpu_spec({"pipeline_model_parallel_size": 8}))["step_seconds"]
    assert tp4["total"] > dp8["total"] > pp8["total"]
    # tp: m 8 microbatches x (8 layers x 8 + 4 x 2 output-layer messages) x (tp - 1), each at a ring
    # of 4's wait; dp 2: 2 (n - 1) per 1M-element gradient bucket at a pair's wait
    grid = grid_of(tp4_spec)
    dense = max(rank_parameters(Shapes.of(tp4_spec), grid, r)["dense"] for r in grid.groups("pp")[0])
    want = 8 * (8 * 8 + 8) * 3 * hop_latency(cl, 4) + -(-dense // 1_000_000) * 2 * hop_latency(cl, 2)
    assert tp4["latency"] == pytest.approx(want)
    assert hop_latency(cl, 4) == dict(cl.hop_latency_s)[4] and hop_latency(cl, 3) == hop_latency(cl, 4)
    assert hop_latency(cl, 1) == 0 and hop_latency(cl, 64) == dict(cl.hop_latency_s)[8]
    assert dp8["dp_exposed"] == dp8["dp"] > 0 and dp8["tp"] == 0
    # dp 8: every rank's gradient bytes (the plan's traffic, all ranks) at the machine's loopback rate,
    # plus 2 x 7 messages per 1M-element bucket at a ring of 8's wait
    from service.spec.plan import plan_job

    sent = sum(plan_job(cpu_spec({}))["traffic"]["dp"].values())
    dense = rank_parameters(Shapes.of(cpu_spec({})), grid_of(cpu_spec({})), 0)["dense"]
    assert dp8["dp"] == pytest.approx(sent / cl.intra_bytes_per_s + -(-dense // 1_000_000) * 14 * hop_latency(cl, 8))
    # with and without SP the same messages (all-gather + reduce-scatter, or all-reduce: tp-1 steps each)
    no_sp = ours(cpu_spec({"tensor_model_parallel_size": 4}))["step_seconds"]
    assert no_sp["latency"] == pytest.approx(tp4["latency"])


def test_on_shared_cores_the_optimizer_update_is_repeated_by_dp_replicas():
    """Every rank streams its state through the machine's memory: dp 8 copies cost 8 times one
    pp 8 stage set; the distributed optimizer shards the moments."""
    plain = ours(cpu_spec({}))["step_seconds"]["optimizer"]
    sharded = ours(cpu_spec({"use_distributed_optimizer": True}))["step_seconds"]["optimizer"]
    pp8 = ours(cpu_spec({"pipeline_model_parallel_size": 8}))["step_seconds"]["optimizer"]
    assert sharded < 0.8 * plain
    assert plain > 7 * pp8  # pp 8 adds only the second vocabulary matrix (embedding and output apart)


def test_the_last_stage_counts_the_logits_gradient():
    """Backward starts with every activation held and the fp32 gradient of the logits (bf16: and
    its cast copy): ``s b V / tp`` x (4 + 2), in the peak of the stage holding the output layer."""
    tokens = LLAMA3_8B["seq_length"]
    for tp in (1, 2):
        act = ours(spec_of(LLAMA3_8B, tp=tp))["activation_bytes"]
        logits = tokens * -(-LLAMA3_8B["vocab_size"] // tp)
        assert act["logits_grad"] == logits * 6, (tp, act)
        assert act["output_layer"] >= act["logits_grad"] + logits * 2  # + the saved bf16 logits
    # pp 2: the first stage is the busier one; no output layer there
    assert ours(spec_of(LLAMA3_8B, tp=2, pp=2))["activation_bytes"]["logits_grad"] == 0
    pp1 = ours(spec_of(LLAMA3_8B))["activation_bytes"]
    assert pp1["total"] == pytest.approx(pp1["layers"] + pp1["embedding"] + pp1["output_layer"])


def test_the_peak_is_state_and_activations_plus_what_a_cpu_rank_process_holds_whatever_the_model():
    """On the simulated CPU cluster a rank's peak (its VmHWM) carries the per-process cost measured
    by bench/cpu_calibrate.py (CPU_FIGURES["process_mb"]); on an accelerator that cost (CUDA
    context, NCCL) lies outside the device budget, left to MEMORY_MARGIN. Breaks if either side
    drops or double-counts the term."""
    gpu = ours(spec_of(LLAMA3_8B, tp=2, pp=2))
    assert gpu["process_bytes"] == 0
    assert gpu["peak_bytes_per_rank"] == gpu["state_bytes"]["total"] + gpu["activation_bytes"]["total"]
    data = spec_of(LLAMA3_8B, tp=2, pp=2).model_dump()
    data["resources"] = {"num_nodes": 1, "gpus_per_node": 8}  # no type: the simulated CPU cluster
    cpu = ours(parse_spec(data))
    assert cpu["process_bytes"] == cost.CPU_FIGURES["process_mb"] * 2**20 > 0
    assert cpu["peak_bytes_per_rank"] == (cpu["state_bytes"]["total"] + cpu["activation_bytes"]["total"]
                                          + cpu["process_bytes"])
    assert cpu["cluster"]["process_mb"] == cost.CPU_FIGURES["process_mb"]


def test_the_gpu_type_a_cluster_reports_is_its_nodes_common_known_ray_label():
    """Ray labels a GPU node ``accelerator_type:<name>`` (ray.util.accelerators); a cluster whose GPU
    nodes all carry one label GPU_FIGURES knows plans with that type; a spec naming an accelerator
    of its own keeps it. Breaks if a mixed or unknown cluster got a type, or a spec's own were overridden."""
    from service.spec.check import with_gpu_type

    assert cost.gpu_type_of(["H100", "H100"]) == "H100"
    assert cost.gpu_type_of(["A100-80G"]) == "A100"
    assert cost.gpu_type_of(["A100-40G"]) is None  # not the A100's 80 GB
    assert cost.gpu_type_of(["H100", "H200"]) is None and cost.gpu_type_of(["H100", None]) is None
    assert cost.gpu_type_of(["T4"]) is None and cost.gpu_type_of([]) is None
    spec = {"name": "x", "resources": {"num_nodes": 1, "gpus_per_node": 8}}
    assert with_gpu_type(spec, "H100")["resources"] == {"num_nodes": 1, "gpus_per_node": 8, "gpu_type": "H100"}
    assert "gpu_type" not in spec["resources"]  # the request's data is not changed in place
    for own in ({"gpu_type": "A100"}, {"gpu_memory_gb": 40}, {"gpu_peak_tflops": 100}):
        mine = {**spec, "resources": {**spec["resources"], **own}}
        assert with_gpu_type(mine, "H100") == mine
    assert with_gpu_type(spec, None) == spec and with_gpu_type([1], "H100") == [1]
