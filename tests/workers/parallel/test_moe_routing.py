"""MoE routing as Qwen3-MoE and DeepSeek-V3 route, against transformers' own modules.

The MoE layer the model builds (:func:`workers.model.decoder.moe_layer`, from a ``ModelConfig``) gets the
weights of a tiny random ``Qwen3MoeSparseMoeBlock`` / ``DeepseekV3MoE`` (transformers' names and
layouts: ``gate.weight``, ``gate.e_score_correction_bias``, ``experts.gate_up_proj [E, 2f, h]``
gate then up, ``experts.down_proj [E, h, f]``, ``shared_experts.{gate,up,down}_proj``). Output
and every gradient agree at ~1e-6, and every token picks the same experts.

The aux-loss-free bias update runs on 4 ranks that each hold a quarter of the tokens; after
every step the bias equals the one computed in one process from the whole batch, with
transformers' DeepSeek-V3 router choosing the experts and Megatron's formula updating the bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.paths import ROOT
from tests.helpers.ranks import run_ranks
from workers.config import ModelConfig
from workers.model.decoder import ShardContext
from workers.model.layer import moe_layer
from workers.parallel.router import Routing, TopKRouter, update_expert_biases

transformers = pytest.importorskip("transformers")

H, F, SEQ, BATCH = 16, 12, 6, 3
TOL = 1e-6


def _model_config(**moe) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=40,
                       vocab_size=32, seq_length=SEQ, moe_ffn_hidden_size=F, **moe)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _copy_experts(ours, hf_experts, hf_router) -> None:
    with torch.no_grad():
        ours.router.weight.copy_(hf_router.weight)
        ours.experts.w_gate.copy_(hf_experts.gate_up_proj[:, :F])
        ours.experts.w_up.copy_(hf_experts.gate_up_proj[:, F:])
        ours.experts.w_down.copy_(hf_experts.down_proj)


def _compare(ours, hf, pairs, hf_indices) -> None:
    """Same output, same input and weight gradients, same experts per token."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SEQ, BATCH, H, generator=g)  # ours: [s, b, h]
    w = torch.randn(SEQ, BATCH, H, generator=g)
    x_ours, x_hf = x.clone().requires_grad_(True), x.transpose(0, 1).contiguous().requires_grad_(True)
    y_ours, _ = ours(x_ours)
    y_hf = hf(x_hf).transpose(0, 1)
    assert (y_ours - y_hf).abs().max() <= TOL * y_hf.abs().max()
    (y_ours * w).sum().backward()
    (y_hf * w).sum().backward()
    assert (x_ours.grad - x_hf.grad.transpose(0, 1)).abs().max() <= TOL * x_hf.grad.abs().max()
    for name, ours_grad, hf_grad in pairs():
        err = (ours_grad - hf_grad).abs().max() / hf_grad.abs().max()
        assert err <= TOL, f"gradient of {name}: relative error {err:.2e}"
    flat = x.reshape(-1, H)  # token t of [s, b] is row t both ways after the transposes
    ours_idx = ours.router.route(torch.nn.functional.linear(flat, ours.router.weight))[1]
    want = hf_indices(x.transpose(0, 1).reshape(-1, H)).view(BATCH, SEQ, -1).transpose(0, 1).reshape(flat.shape[0], -1)
    assert torch.equal(ours_idx.sort(-1).values, want.sort(-1).values), "the tokens chose different experts"


def _expert_grads(ours, hf_experts, hf_router):
    def pairs():
        yield "router", ours.router.weight.grad, hf_router.weight.grad
        yield "gate", ours.experts.w_gate.grad, hf_experts.gate_up_proj.grad[:, :F]
        yield "up", ours.experts.w_up.grad, hf_experts.gate_up_proj.grad[:, F:]
        yield "down", ours.experts.w_down.grad, hf_experts.down_proj.grad
    return pairs


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_matches_transformers(norm_topk_prob):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=norm_topk_prob)
    hf = Qwen3MoeSparseMoeBlock(hf_cfg).float()
    _randomize(hf, 0)
    # norm_topk_prob: false is Megatron's moe_router_pre_softmax (softmax over all, then top-k).
    ours = moe_layer(_model_config(num_moe_experts=8, moe_router_topk=3, moe_router_pre_softmax=not norm_topk_prob),
                     ShardContext(), "layers.0.mlp")
    _copy_experts(ours, hf.experts, hf.gate)
    _compare(ours, hf, _expert_grads(ours, hf.experts, hf.gate), lambda x: hf.gate(x)[2])


E_DS = 16


def _deepseek(seed: int = 0):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    # 16 experts in 4 groups, a token uses 2 groups and 4 of their 8 experts (groups ranked by their
    # top 4 / 2 = 2 scores, transformers' fixed 2); 2 shared experts of size F.
    hf_cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=F, n_routed_experts=E_DS, num_experts_per_tok=4,
                              n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    hf = DeepseekV3MoE(hf_cfg).float()
    _randomize(hf, seed)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.copy_(torch.randn(E_DS, generator=torch.Generator().manual_seed(9)) * 0.1)
    return hf


DEEPSEEK_ROUTING = dict(num_moe_experts=E_DS, moe_router_topk=4, moe_router_score_function="sigmoid",
                        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)


def test_deepseek_v3_moe_matches_transformers():
    hf = _deepseek()
    cfg = _model_config(**DEEPSEEK_ROUTING, moe_router_enable_expert_bias=True,
                        moe_shared_expert_intermediate_size=2 * F)
    ours = moe_layer(cfg, ShardContext(), "layers.0.mlp")
    _copy_experts(ours, hf.experts, hf.gate)
    s = hf.shared_experts
    with torch.no_grad():
        ours.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
        ours.shared_mlp.gate_up.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
        ours.shared_mlp.down.weight.copy_(s.down_proj.weight)
    # The test can fail: the groups and the bias each change some token's experts here.
    x = torch.randn(SEQ * BATCH, H, generator=torch.Generator().manual_seed(5))
    scores = torch.sigmoid(x @ hf.gate.weight.t())
    plain = torch.topk(scores, 4).indices.sort(-1).values
    unbiased = TopKRouter(hf.gate.weight.detach(), 4, routing=Routing.of(_model_config(**DEEPSEEK_ROUTING)))
    chosen = ours.router.route(x @ hf.gate.weight.t())[1].sort(-1).values
    assert not torch.equal(unbiased.route(x @ hf.gate.weight.t())[1].sort(-1).values, plain)
    assert not torch.equal(unbiased.route(x @ hf.gate.weight.t())[1].sort(-1).values, chosen)

    def pairs():
        yield from _expert_grads(ours, hf.experts, hf.gate)()
        f2 = 2 * F
        yield "shared gate", ours.shared_mlp.gate_up.weight.grad[:f2], s.gate_proj.weight.grad
        yield "shared up", ours.shared_mlp.gate_up.weight.grad[f2:], s.up_proj.weight.grad
        yield "shared down", ours.shared_mlp.down.weight.grad, s.down_proj.weight.grad

    _compare(ours, hf, pairs, lambda x: hf.gate(x)[2])


# ---------------------------------------------------------------------------------------------
# Aux-loss-free balancing: the bias update from the global loads
# ---------------------------------------------------------------------------------------------

RATE, STEPS, WORLD, TOKENS = 0.05, 4, 4, 40  # TOKENS per rank per microbatch, 2 microbatches


def _tokens(step: int, mb: int) -> torch.Tensor:
    """The global batch's microbatch ``mb`` at ``step``: ``[WORLD * TOKENS, H]``."""
    return torch.randn(WORLD * TOKENS, H, generator=torch.Generator().manual_seed(100 * step + mb))


def _bias_worker(rank, world, router_weight):
    cfg = _model_config(**DEEPSEEK_ROUTING, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=RATE)
    router = TopKRouter(router_weight, 4, routing=Routing.of(cfg))
    biases = []
    for step in range(STEPS):
        for mb in range(2):
            router(_tokens(step, mb)[rank * TOKENS : (rank + 1) * TOKENS])
        with torch.no_grad():  # an evaluation forward: its choices are not training loads
            router(_tokens(step, 7))
        update_expert_biases([router], dist.group.WORLD)
        biases.append(router.expert_bias.clone())
    return biases


@pytest.mark.slow
def test_expert_bias_updates_from_global_loads():
    hf = _deepseek()
    gate = hf.gate
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
    per_rank = run_ranks(_bias_worker, WORLD, args=(gate.weight.detach().clone(),))
    changed = False
    for step in range(STEPS):
        idx = torch.cat([gate(_tokens(step, mb))[2] for mb in range(2)]).sort(-1).values
        with torch.no_grad():
            bias = gate.e_score_correction_bias.clone()
            gate.e_score_correction_bias.zero_()
            changed |= not torch.equal(idx, torch.cat([gate(_tokens(step, mb))[2] for mb in range(2)]).sort(-1).values)
            gate.e_score_correction_bias.copy_(bias)
        load = torch.bincount(idx.reshape(-1), minlength=E_DS).float()
        with torch.no_grad():  # Megatron's get_updated_expert_bias on the whole batch
            gate.e_score_correction_bias += torch.sign(load.mean() - load) * RATE
        for rank, biases in enumerate(per_rank):
            assert torch.equal(biases[step], gate.e_score_correction_bias), (
                f"step {step}, rank {rank}: bias {biases[step].tolist()} != {gate.e_score_correction_bias.tolist()}")
    # The bias changed the routing: the later steps checked the biased choice.
    assert changed


# ---------------------------------------------------------------------------------------------
# The sequence-wise aux loss, the MoE layers of a model, the spec's refusals
# ---------------------------------------------------------------------------------------------


def test_seq_aux_loss_is_the_mean_of_each_sequences_switch_loss():
    """DeepSeek-V3's sequence-wise balance loss: per sequence b, ``coeff * sum_e f_be P_be`` with
    ``f_be = E / (k S) * (choices of e in b)`` and ``P_be`` the mean normalised score; averaged
    over the sequences (Megatron's seq_aux_loss). Independent loops over the sequences here."""
    cfg = _model_config(**DEEPSEEK_ROUTING, moe_router_load_balancing_type="seq_aux_loss")
    weight = torch.randn(E_DS, H, generator=torch.Generator().manual_seed(3))
    router = TopKRouter(weight, 4, aux_loss_coeff=0.1, routing=Routing.of(cfg))
    x = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(4))
    got = router(x.reshape(-1, H), BATCH)[2].detach()
    want = 0.0
    for b in range(BATCH):
        scores = torch.sigmoid(x[:, b] @ weight.t())
        scores = scores / scores.sum(-1, keepdim=True)
        picked = torch.topk(scores, 4).indices
        f = torch.stack([(picked == e).sum() for e in range(E_DS)]).float() * E_DS / (4 * SEQ)
        want += 0.1 * (f * scores.mean(0)).sum() / BATCH
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
    microbatch = TopKRouter(weight, 4, aux_loss_coeff=0.1, routing=Routing.of(_model_config(**DEEPSEEK_ROUTING)))
    assert abs(float(microbatch(x.reshape(-1, H), BATCH)[2].detach()) - float(want)) > 1e-3 * abs(float(want))


@pytest.mark.parametrize("freq,moe_layers", [(1, [0, 1, 2, 3]), (2, [0, 2]), ((0, 1, 1, 1), [1, 2, 3])])
def test_moe_layer_freq_picks_the_moe_layers(freq, moe_layers):
    from workers.model.decoder import ModelChunk
    from workers.model.layer import MLP
    from workers.parallel.expert import MoELayer

    cfg = ModelConfig(num_layers=4, hidden_size=H, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=40,
                      vocab_size=32, seq_length=SEQ, num_moe_experts=4, moe_ffn_hidden_size=F, moe_layer_freq=freq)
    chunk = ModelChunk(cfg, ShardContext(), [0, 1, 2, 3], pre_process=True, post_process=True,
                       positions=torch.arange(SEQ))
    assert [i for i, layer in enumerate(chunk.layers) if isinstance(layer.mlp, MoELayer)] == moe_layers
    for i, layer in enumerate(chunk.layers):
        if i not in moe_layers:
            assert isinstance(layer.mlp, MLP) and layer.mlp.down.weight.shape == (H, 40)  # the dense ffn
        else:
            assert layer.mlp.experts.w_down.shape == (4, H, F)


def _spec(**model):
    return {"name": "t", "model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                                   "ffn_hidden_size": 64, "num_moe_experts": 8, "moe_router_topk": 4, **model},
            "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
            "training": {"train_iters": 1, "global_batch_size": 2, "micro_batch_size": 1},
            "resources": {"num_nodes": 1, "gpus_per_node": 2}}


@pytest.mark.parametrize("model,needles", [
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, ["moe_router_num_groups 3 does not divide "
                                                                "num_moe_experts 8"]),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 3}, ["moe_router_group_topk 3 > moe_router_num_groups 2"]),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 1}, ["moe_router_topk 4 > moe_router_group_topk 1 x "
                                                                "experts per group 2"]),
    ({"moe_router_topk": 2, "moe_router_num_groups": 8, "moe_router_group_topk": 4},
     ["moe_router_group_topk 4 > moe_router_topk 2"]),
    ({"moe_router_num_groups": 2}, ["moe_router_num_groups and moe_router_group_topk go together"]),
    ({"moe_router_enable_expert_bias": True}, ["moe_router_enable_expert_bias needs moe_router_score_function: "
                                               "sigmoid"]),
    ({"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": True}, ["moe_router_pre_softmax"]),
    ({"moe_router_score_function": "relu"}, ["model.moe_router_score_function"]),
    ({"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.01}, ["moe_aux_loss_coeff 0.01",
                                                                              "set it to 0"]),
    ({"moe_layer_freq": [0, 1, 1]}, ["moe_layer_freq [0, 1, 1] must list model.num_layers 4 values",
                                     "[0, 1, 1, 1]"]),
    ({"moe_layer_freq": [0, 2, 1, 1]}, ["moe_layer_freq [0, 2, 1, 1]"]),
    ({"moe_layer_freq": 5}, ["moe_layer_freq 5 must be between 1 and model.num_layers 4"]),
    ({"moe_ffn_hidden_size": 33}, ["model.moe_ffn_hidden_size 33", "expert_tensor_parallel_size 2"]),
    ({"moe_shared_expert_intermediate_size": 33}, ["model.moe_shared_expert_intermediate_size 33",
                                                   "tensor_model_parallel_size 2"]),
    ({"num_moe_experts": None, "moe_router_score_function": "sigmoid"},
     ["model.moe_router_score_function is for MoE models"]),
    ({"moe_router_bias_update_rate": 0}, ["model.moe_router_bias_update_rate"]),
])
def test_bad_routing_fields_are_refused_naming_them(model, needles):
    from service.spec.spec import parse_spec

    with pytest.raises(ValueError) as e:
        parse_spec(_spec(**model))
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_routing_fields_reach_the_model_config():
    from service.spec.spec import parse_spec, to_job_config

    m = to_job_config(parse_spec(_spec(**DEEPSEEK_ROUTING | {"num_moe_experts": 8, "moe_layer_freq": [0, 1, 1, 1],
                                                             "moe_router_enable_expert_bias": True}))).model
    assert Routing.of(m) == Routing("sigmoid", False, 2.5, 4, 2, True, 1e-3, "aux_loss")
    assert m.moe_layer_freq == (0, 1, 1, 1) and [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


@pytest.mark.slow
def test_expert_bias_is_saved_and_resharded(tmp_path):
    """A checkpoint holds every expert bias; loaded at another layout (tp2 + sp + ep2 from one
    process), every rank has them, and the next iteration's loss is the uninterrupted run's."""
    from tests.helpers.parity import V3_MODEL, V3_TRAIN, job_of, tiny_spec
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.train.trainer import Trainer

    t = Trainer(job_of(tiny_spec(model=V3_MODEL, training=V3_TRAIN)), 0, 1)
    for _ in range(3):
        t.train_step()
    Checkpointer(str(tmp_path)).save(t)
    want_bias = {f"layers.{i}.mlp.router.expert_bias": t.chunks[0].layers[i].mlp.router.expert_bias.clone()
                 for i in (1, 2, 3)}
    assert all(b.any() for b in want_bias.values())
    want_loss = t.train_step()["loss"]
    spec = tiny_spec(model=V3_MODEL, training=V3_TRAIN, world=4, parallel={
        "tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2})
    per_rank = run_ranks(_resume_worker, 4, args=(job_of(spec), str(tmp_path)), timeout_s=300)
    for biases, loss in per_rank:
        assert biases.keys() == want_bias.keys()
        assert all(torch.equal(biases[k], want_bias[k]) for k in want_bias)
        assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)


def _resume_worker(rank, world, job, root):
    from workers.checkpoint.reader import load_checkpoint
    from workers.train.trainer import Trainer

    t = Trainer(job, rank, world)
    load_checkpoint(t, root)
    biases = {f"layers.{layer.index}.mlp.router.expert_bias": layer.mlp.router.expert_bias.clone()
              for layer in t.chunks[0].layers if hasattr(layer.mlp, "router")}
    return biases, t.train_step()["loss"]


def test_expert_bias_stays_float32_through_a_bf16_cast():
    """A bf16 model keeps its expert biases in float32, unrounded (they hold steps of the update rate)."""
    router = TopKRouter(torch.randn(E_DS, H), 4, routing=Routing.of(_model_config(
        **DEEPSEEK_ROUTING, moe_router_enable_expert_bias=True)))
    with torch.no_grad():
        router.expert_bias.fill_(0.0123)
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    assert torch.equal(router.expert_bias, torch.full((E_DS,), 0.0123))
    assert router.tokens_per_expert.dtype == torch.int64
    router(torch.randn(6, H, dtype=torch.bfloat16))
    assert int(router.tokens_per_expert.sum()) == 6 * 4


def test_bf16_training_with_deepseek_v3_routing():
    """bf16 compute (fp32 main params): the routing trains, the biases stay float32 and move."""
    from tests.helpers.parity import V3_MODEL, V3_TRAIN, job_of, tiny_spec
    from workers.train.trainer import Trainer

    t = Trainer(job_of(tiny_spec(model=V3_MODEL, training={**V3_TRAIN, "bf16": True})), 0, 1)
    losses = [t.train_step()["loss"] for _ in range(3)]
    assert all(5.0 < loss < 6.0 for loss in losses) and losses[-1] < losses[0]
    for layer in t.chunks[0].layers[1:]:
        assert layer.mlp.router.weight.dtype == torch.bfloat16
        assert layer.mlp.router.expert_bias.dtype == torch.float32 and layer.mlp.router.expert_bias.any()


@pytest.mark.procs
def test_spec_validation_of_routing_imports_no_torch():
    """The spec's routing rules are pure (service/spec imports no torch): a DeepSeek-V3-style spec
    and a refused one are checked without it."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from service.spec.spec import parse_spec; from tests.helpers.parity import V3_MODEL, tiny_spec\n"
            "parse_spec(tiny_spec(model=V3_MODEL))\n"
            "try: parse_spec(tiny_spec(model={**V3_MODEL, 'moe_router_group_topk': 3}))\n"
            "except ValueError as e: assert 'moe_router_group_topk 3' in str(e)\n"
            "else: raise SystemExit('not refused')\n"
            "sys.stderr.write(str('torch' in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert p.returncode == 0 and p.stderr.endswith("False"), p.stderr
