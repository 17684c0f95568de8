"""Qwen3-MoE and DeepSeek-V3 against transformers: tiny random models built with transformers' own
config classes and saved with save_pretrained. ``model: {from_hf: DIR}`` fills every architecture
field (MoE routing, MLA, YaRN); ``hf:DIR`` gives transformers' logits, loss and every gradient,
and its first loss at tp2 x ep2; an exported trained checkpoint (the expert bias moved) loads in
transformers as the same class with raytron's logits.

Qwen3-MoE: a dense first layer (mlp_only_layers), softmax over all experts not renormalised
(norm_topk_prob: false), q/k norms, head_dim 16 where hidden / heads is 8. DeepSeek-V3: a dense
first layer (first_k_dense_replace 1), sigmoid routing in 4 groups of which 2 (n_group /
topk_group), a nonzero e_score_correction_bias, a shared expert, routed_scaling_factor 2.5,
compressed queries (q_lora_rank) and YaRN with every knob away from neutral."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers.parity import job_of
from tests.helpers.hf import assert_close, hf_logits, raytron_logits
from tests.helpers.hf import assert_first_loss_is_transformers, assert_same_grads, export_hf, imported_grads_against_transformers, spec

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 1024, "beta_fast": 4.0, "beta_slow": 1.0}
ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def save_family(kind: str, path):
    """A random model of ``kind``, norms away from 1 and expert biases random (a dropped load
    would show)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(5)
    if kind == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
            mlp_only_layers=[0], rope_theta=1000000.0, **COMMON))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=6, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, first_k_dense_replace=1, rope_parameters=YARN, **COMMON))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 0.2)  # routing decided by clear margins, experts that matter
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.3)
    model.float().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {kind: save_family(kind, tmp_path_factory.mktemp(kind)) for kind in ARCH}


@pytest.fixture(params=list(ARCH))
def family(request, saved):
    return request.param, saved[request.param]


def trainer(path):
    from workers.train.trainer import Trainer

    return Trainer(job_of(spec(path)), 0, 1)


def test_from_hf_fills_every_architecture_field(family):
    kind, path = family
    m = job_of(spec(path)).model
    assert (m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.vocab_size, m.moe_ffn_hidden_size) == (
        32, 4, 64, 256, 16)
    assert m.moe_layer_freq == (0, 1) and m.untie_embeddings_and_output_weights
    if kind == "qwen3_moe":
        assert (m.num_query_groups, m.kv_channels, m.qk_layernorm, m.multi_latent_attention) == (2, 16, True, False)
        assert (m.num_moe_experts, m.moe_router_topk, m.moe_router_score_function, m.moe_router_pre_softmax,
                m.moe_shared_expert_intermediate_size, m.rotary_base) == (4, 2, "softmax", True, None, 1000000.0)
        return
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_router_score_function, m.moe_router_num_groups,
            m.moe_router_group_topk, m.moe_router_enable_expert_bias, m.moe_router_topk_scaling_factor,
            m.moe_shared_expert_intermediate_size) == (8, 4, "sigmoid", 4, 2, True, 2.5, 16)
    assert (m.multi_latent_attention, m.num_query_groups, m.kv_channels, m.q_lora_rank, m.kv_lora_rank,
            m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (True, 4, None, 16, 12, 8, 8, 6)
    assert (m.rotary_scaling_factor, m.mscale, m.mscale_all_dim, m.original_max_position_embeddings, m.beta_fast,
            m.beta_slow, m.rotary_base) == (4.0, 0.9, 0.7, 1024, 4.0, 1.0, 10000.0)


@pytest.mark.parametrize("field, value, needle", [
    ("num_moe_experts", 16, "model.num_moe_experts: 16 in the spec"),
    ("moe_layer_freq", 1, "model.moe_layer_freq: 1 in the spec, [0, 1]"),
    ("qk_pos_emb_head_dim", 4, "model.qk_pos_emb_head_dim: 4 in the spec, 8"),
    ("mscale_all_dim", 1.0, "model.mscale_all_dim: 1.0 in the spec, 0.7"),
    ("moe_router_topk_scaling_factor", 1.5, "model.moe_router_topk_scaling_factor: 1.5 in the spec, 2.5"),
], ids=["experts", "layer-freq", "mla", "yarn", "scaling"])
def test_from_hf_refuses_a_field_that_disagrees(saved, field, value, needle):
    from service.spec.spec import parse_spec

    kind = "qwen3_moe" if field in ("num_moe_experts", "moe_layer_freq") else "deepseek_v3"
    with pytest.raises(ValueError, match=rf"{re.escape(needle)}.*remove model\.{field} \(from_hf fills it\)"):
        parse_spec(spec(saved[kind], **{field: value}))


def _fused_expert_grads(got: dict, name: str) -> torch.Tensor:
    """transformers' in-memory fused expert parameter ``name`` (``experts.gate_up_proj [E, 2f, h]``
    or ``experts.down_proj [E, h, f]``) from the per-expert tensors of :func:`to_hf`."""
    p, which = name.rsplit(".", 1)
    count = sum(1 for k in got if k.startswith(f"{p}.") and k.endswith(".down_proj.weight"))
    if which == "gate_up_proj":
        return torch.stack([torch.cat([got[f"{p}.{e}.gate_proj.weight"], got[f"{p}.{e}.up_proj.weight"]])
                            for e in range(count)])
    return torch.stack([got[f"{p}.{e}.down_proj.weight"] for e in range(count)])


def test_hf_import_gives_transformers_logits_loss_and_every_gradient(family):
    """Logits, loss and the gradient of every parameter against transformers on one batch, and
    the expert biases loaded exactly."""
    from workers.checkpoint.layout import buffer_views
    from workers.hf.interop import to_hf

    kind, path = family
    t, got, want_grads = imported_grads_against_transformers(path)
    for name in [n for n in want_grads if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        got[name] = _fused_expert_grads(got, name)
    assert_same_grads({k: v for k, v in got.items() if k in want_grads or ".experts." not in k}, want_grads)
    m = {k: getattr(t.job.model, k) for k in t.job.model.__dataclass_fields__}
    biases = buffer_views(t)
    assert len(biases) == (1 if kind == "deepseek_v3" else 0)
    from safetensors.torch import load_file

    hub = load_file(path / "model.safetensors")
    for v in biases:
        (hf_name,) = to_hf(v.name, v.param, m)
        assert torch.equal(v.param, hub[hf_name]) and v.param.abs().max() > 0


def test_hf_import_at_tp2_ep2_gives_the_transformers_first_loss(family):
    """hf:DIR at tp2 x ep2 with sequence parallelism (MoE with TP needs it): Qwen3-MoE on 4 ranks
    (dp2, the experts also split over TP), DeepSeek-V3 on 2 (the experts split over the TP
    ranks, expert_tensor_parallel_size 1). The first loss is transformers' on that batch."""
    kind, path = family
    parallel = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2}
    if kind == "deepseek_v3":
        parallel["expert_tensor_parallel_size"] = 1
    assert_first_loss_is_transformers(path, 4 if kind == "qwen3_moe" else 2, parallel)


def test_export_of_a_trained_checkpoint_loads_as_the_same_class(family, tmp_path):
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.layout import buffer_views

    kind, path = family
    t = trainer(path)
    before = [v.param.clone() for v in buffer_views(t)]
    for _ in range(3):  # trained weights; the expert bias moves each step
        t.train_step()
    Checkpointer(str(tmp_path / "ckpt")).save(t)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    name, got = hf_logits(tmp_path / "hf", ids)
    assert name == ARCH[kind]
    assert_close(got, raytron_logits(t, ids))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == kind
    if kind == "deepseek_v3":
        from safetensors.torch import load_file

        (bias,) = buffer_views(t)
        exported = load_file(tmp_path / "hf" / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert torch.equal(exported, bias.param) and not torch.equal(exported, before[0])


def test_a_dense_mla_model_exports_as_deepseek_v3_and_imports_back(tmp_path):
    """Without experts an MLA model is a DeepSeek-V3 whose layers are all dense
    (first_k_dense_replace = num_layers); ``from_hf`` reads it back as dense, ``hf:DIR`` loads it."""
    from tests.helpers.parity import tiny_spec
    from tests.helpers.hf import MLA
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source
    from workers.hf.export import export_hf
    from workers.train.trainer import Trainer

    t = Trainer(job_of(tiny_spec(model={**MLA, "num_layers": 2, "norm_epsilon": 1e-6})), 0, 1)
    t.train_step()
    Checkpointer(str(tmp_path / "ckpt")).save(t)
    assert export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))["architecture"] == "DeepseekV3ForCausalLM"
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    name, want = hf_logits(tmp_path / "hf", ids)
    assert name == "DeepseekV3ForCausalLM"
    assert_close(raytron_logits(t, ids), want)
    back = Trainer(job_of(spec(tmp_path / "hf")), 0, 1)
    assert back.job.model.num_moe_experts is None and back.job.model.rotary_scaling_factor == 4.0
    load_checkpoint(back, open_source(f"hf:{tmp_path / 'hf'}"))
    assert_close(raytron_logits(back, ids), want)


@pytest.mark.parametrize("model, needle", [
    ({"num_moe_experts": 4, "moe_router_score_function": "sigmoid"}, "sigmoid is DeepSeek-V3's, whose attention"),
    ({"num_moe_experts": 4, "moe_shared_expert_intermediate_size": 16}, "moe_shared_expert_intermediate_size 16: "
                                                                         "Mixtral"),
    ({"num_moe_experts": 4, "qk_layernorm": True, "moe_shared_expert_intermediate_size": 16},
     "Qwen3-MoE has no shared experts"),
    ({"multi_latent_attention": True, "norm_epsilon": 1e-5}, "norm_epsilon 1e-05: DeepSeek-V3's q_a_layernorm"),
    ({"multi_latent_attention": True, "norm_epsilon": 1e-6, "num_moe_experts": 8, "moe_router_topk": 6,
      "moe_router_score_function": "sigmoid", "moe_router_num_groups": 4, "moe_router_group_topk": 2},
     "moe_router_topk 6 // moe_router_group_topk 2 != 2"),
], ids=["sigmoid-gqa", "mixtral-shared", "qwen3-moe-shared", "mla-eps", "groups"])
def test_export_refuses_a_model_no_family_expresses(model, needle):
    import dataclasses

    from workers.config import ModelConfig
    from workers.hf.families import hf_config

    m = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                    vocab_size=256, seq_length=16, **model)
    with pytest.raises(ValueError, match=re.escape(needle)):
        hf_config(dataclasses.asdict(m))


@pytest.mark.parametrize("change, needle", [
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05 is not supported"),
    ({"rope_interleave": False}, "rope_interleave: false"),
    ({"attention_bias": True}, "attention_bias: true"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.2}}, "attention_factor"),
], ids=["eps", "interleave", "bias", "attention-factor"])
def test_import_refuses_a_deepseek_v3_config_it_cannot_reproduce(saved, change, needle):
    from workers.hf.families import model_from_hf_config

    c = json.loads((saved["deepseek_v3"] / "config.json").read_text())
    with pytest.raises(ValueError, match=f"hf: deepseek_v3: .*{needle}"):
        model_from_hf_config({**c, **change})


def test_a_job_with_other_yarn_or_routing_does_not_load_the_model(saved):
    """The MLA, YaRN and routing fields are part of the model a checkpoint holds: a job that
    differs in one is refused, naming it, not run with the wrong rotary or router."""
    import dataclasses

    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source
    from workers.train.trainer import Trainer

    path = saved["deepseek_v3"]
    job = job_of(spec(path))
    for change, needle in (({"mscale": 1.0}, "model.mscale: 0.9 there, 1.0 in this job"),
                           ({"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False},
                            "model.moe_router_score_function: 'sigmoid' there, 'softmax' in this job")):
        t = Trainer(dataclasses.replace(job, model=dataclasses.replace(job.model, **change)), 0, 1)
        with pytest.raises(ValueError, match=re.escape(needle)):
            load_checkpoint(t, open_source(f"hf:{path}"))


def test_transformers_5_fused_expert_tensors_load_too(saved, tmp_path):
    """A directory holding transformers 5's in-memory expert names (``experts.gate_up_proj
    [E, 2f, h]``, ``experts.down_proj [E, h, f]``; f the expert ffn, not the dense layers') loads as
    the per-expert one does."""
    import shutil

    from safetensors.torch import load_file, save_file

    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source

    path = saved["qwen3_moe"]
    fused, experts = {}, {}  # experts: prefix -> proj -> {expert: tensor}
    for name, t in load_file(path / "model.safetensors").items():
        if ".mlp.experts." in name:
            p, e, proj, _ = name.rsplit(".", 3)
            experts.setdefault(p, {}).setdefault(proj, {})[int(e)] = t
        else:
            fused[name] = t
    for p, projs in experts.items():
        w = {proj: torch.stack([by[e] for e in sorted(by)]) for proj, by in projs.items()}
        fused[f"{p}.gate_up_proj"] = torch.cat([w["gate_proj"], w["up_proj"]], dim=1)
        fused[f"{p}.down_proj"] = w["down_proj"]
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 32)  # [E, 2 x 16, h]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(fused, tmp_path / "model.safetensors")
    t = trainer(path)
    load_checkpoint(t, open_source(f"hf:{tmp_path}"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    assert_close(raytron_logits(t, ids), hf_logits(path, ids)[1])


def test_moe_layer_freq_of_all_moe_and_all_dense_configs(saved):
    """Every layer MoE reads as moe_layer_freq 1 (the default, so a spec without it loads the
    model); DeepSeek-V3 with every layer dense reads as a dense MLA model."""
    from workers.hf.families import model_from_hf_config

    q = json.loads((saved["qwen3_moe"] / "config.json").read_text())
    assert model_from_hf_config({**q, "mlp_only_layers": []})["moe_layer_freq"] == 1
    d = json.loads((saved["deepseek_v3"] / "config.json").read_text())
    m = model_from_hf_config({**d, "first_k_dense_replace": 2})
    assert m["num_moe_experts"] is None and "moe_layer_freq" not in m and m["multi_latent_attention"]
