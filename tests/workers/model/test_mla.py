"""Multi-latent attention (workers/model/mla.py, workers/model/yarn.py) against transformers' DeepseekV3Attention
and its YaRN rotary embedding, and a whole dense MLA model against DeepseekV3ForCausalLM, with the
weights copied in: outputs, loss and every gradient at 1e-6; its spec fields' rules; and
``raytron plan``'s counts of it against the real model.
(Layout invariance: tests/workers/model/test_mla_parity.py.)"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from service.spec.cost import megatron_flops
from service.spec.limits import rank_params
from service.spec.plan import plan_job
from service.spec.shapes import Shapes
from service.spec.spec import parse_spec, to_job_config
from workers.config import ModelConfig

pytest.importorskip("transformers")

# YaRN with every knob away from its neutral value: mscale / mscale_all_dim scale cos, sin and the
# softmax; original_max_position_embeddings 1024 and beta_fast 4 put the ramp inside the 4
# frequencies (one extrapolated, one half-way, two interpolated).
YARN = {"factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7, "original_max_position_embeddings": 1024,
        "beta_fast": 4.0, "beta_slow": 1.0}
DIMS = {"kv_lora_rank": 12, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8, "v_head_dim": 6}


def hf_config(q_lora_rank, yarn: bool):
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN} if yarn else {"rope_type": "default",
                                                                              "rope_theta": 10000.0}
    cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
                           kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6, rms_norm_eps=1e-6,
                           max_position_embeddings=4096, rope_parameters=rope)
    cfg._attn_implementation = "sdpa"
    return cfg


def our_config(q_lora_rank, yarn: bool) -> ModelConfig:
    scaling = {"rotary_scaling_factor": YARN["factor"], **{k: v for k, v in YARN.items() if k != "factor"}}
    return ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                       vocab_size=16, seq_length=16, norm_epsilon=1e-6, multi_latent_attention=True,
                       q_lora_rank=q_lora_rank, **DIMS, **(scaling if yarn else {}))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q-lora", "no-q-lora"])
def test_mla_matches_transformers_forward_and_every_gradient(q_lora_rank):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from workers.model.decoder import RMSNorm, ShardContext
    from workers.model.mla import MLAttention
    from workers.model.yarn import mla_rotary_tables

    torch.manual_seed(0)
    hf = hf_config(q_lora_rank, yarn=True)
    ref = DeepseekV3Attention(hf, 0).float()
    for p in ref.parameters():  # norm weights away from 1 too, so their gradients matter
        torch.nn.init.normal_(p, std=0.2)
    cfg = our_config(q_lora_rank, yarn=True)
    ours = MLAttention(cfg, ShardContext(), "layers.0.attention", norm=RMSNorm)
    ours.load_state_dict(ref.state_dict(), strict=True)  # transformers' names and layout, 1:1

    b, s = 2, 16
    x_ref = torch.randn(b, s, 32, requires_grad=True)
    x = x_ref.detach().transpose(0, 1).clone().requires_grad_(True)  # ours: [s, b, h]
    positions = torch.arange(s)
    y_ref, _ = ref(x_ref, DeepseekV3RotaryEmbedding(hf)(x_ref, positions[None].expand(b, s)), None)
    y = ours(x, mla_rotary_tables(positions, cfg))
    assert rel(y.detach().transpose(0, 1), y_ref.detach()) < 1e-6
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y.backward(dy.transpose(0, 1))
    assert rel(x.grad.transpose(0, 1), x_ref.grad) < 1e-6
    theirs = dict(ref.named_parameters())
    assert sorted(theirs) == sorted(n for n, _ in ours.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, theirs[name].grad) < 1e-6, name


@pytest.mark.parametrize("yarn", [True, False], ids=["yarn", "plain-rope"])
def test_rotary_tables_and_softmax_scale_match_transformers(yarn):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from workers.model.yarn import mla_rotary_tables, mla_softmax_scale

    hf = hf_config(16, yarn)
    positions = torch.arange(64)
    cos, sin = DeepseekV3RotaryEmbedding(hf)(torch.zeros(1), positions[None])
    ours = mla_rotary_tables(positions, our_config(16, yarn))  # [2, s, 1, 1, d/2]
    half = cos.shape[-1] // 2
    torch.testing.assert_close(ours[0, :, 0, 0], cos[0, :, :half], rtol=0, atol=1e-7)
    torch.testing.assert_close(ours[1, :, 0, 0], sin[0, :, :half], rtol=0, atol=1e-7)
    assert mla_softmax_scale(our_config(16, yarn)) == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
    if yarn:  # the knobs are live: a plain table would differ
        assert not torch.allclose(ours, mla_rotary_tables(positions, our_config(16, False)))


def mla_spec(world=1, parallel=None, **model):
    return {"name": "mla",
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
                      "vocab_size": 250, "seq_length": 16, "multi_latent_attention": True, "q_lora_rank": 16,
                      **DIMS, "rotary_scaling_factor": 4.0, "mscale_all_dim": 1.0, **model},
            "parallel": parallel or {},
            "training": {"global_batch_size": 4, "micro_batch_size": 1},
            "resources": {"num_nodes": 1, "gpus_per_node": world}}


def refused(spec, *needles) -> str:
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return str(e.value)


@pytest.mark.parametrize("model, needles", [
    ({"multi_latent_attention": False}, ["model.q_lora_rank 16 is for multi-latent attention",
                                         "model.rotary_scaling_factor 4.0", "multi_latent_attention: true"]),
    ({"num_query_groups": 2}, ["model.num_query_groups 2", "drop model.num_query_groups"]),
    ({"qk_pos_emb_head_dim": 5}, ["model.qk_pos_emb_head_dim 5 must be even"]),
    ({"rotary_scaling_factor": 1.0}, ["model.mscale_all_dim 1.0 has no effect without YaRN",
                                      "model.rotary_scaling_factor above 1"]),
    ({"beta_fast": 1.0}, ["model.beta_fast 1 must be above model.beta_slow 1"]),
    ({"rotary_scaling_factor": 0.5}, ["model.rotary_scaling_factor", "greater than or equal to 1"]),
    ({"kv_lora_rank": 0}, ["model.kv_lora_rank", "greater than or equal to 1"]),
    ({"add_qkv_bias": True, "qk_layernorm": True, "kv_channels": 16},
     ["model.add_qkv_bias is for grouped-query attention", "model.qk_layernorm is for", "model.kv_channels is for",
      "drop model.kv_channels"]),
])
def test_bad_mla_fields_are_refused_naming_the_field(model, needles):
    refused(mla_spec(**copy.deepcopy(model)), *needles)


def test_hugging_face_import_of_an_mla_model_is_allowed():
    """DeepSeek-V3 import is there (tests/workers/hf/test_hf_moe_families.py): the spec no longer refuses it."""
    parse_spec({**mla_spec(), "checkpoint": {"load": "hf:/models/dsv3"}})


def test_mla_spec_reaches_the_job_config_and_dense_specs_are_unchanged():
    m = to_job_config(parse_spec(mla_spec())).model
    assert (m.multi_latent_attention, m.q_lora_rank, m.qk_pos_emb_head_dim, m.rotary_scaling_factor,
            m.mscale_all_dim, m.num_query_groups) == (True, 16, 8, 4.0, 1.0, 4)
    dense = mla_spec(multi_latent_attention=False, q_lora_rank=None, rotary_scaling_factor=1.0, mscale_all_dim=0.0,
                     kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    assert not to_job_config(parse_spec(dense)).model.multi_latent_attention


@pytest.mark.procs
def test_cli_refuses_a_bad_mla_spec_with_exit_2(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    path = tmp_path / "mla.yaml"
    path.write_text(yaml.safe_dump(mla_spec(num_query_groups=2)))
    p = subprocess.run([str(Path(sys.executable).with_name("raytron")), "plan", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "model.num_query_groups 2" in p.stderr, (p.returncode, p.stderr)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q-lora", "no-q-lora"])
def test_plan_counts_the_real_mla_model(q_lora_rank):
    from workers.model.decoder import ModelChunk, ShardContext

    spec = parse_spec(mla_spec(q_lora_rank=q_lora_rank))
    job = to_job_config(spec)
    chunk = ModelChunk(job.model, ShardContext(seed=1), [0, 1], pre_process=True, post_process=True,
                       positions=torch.arange(16))
    plan = plan_job(spec)
    numel = sum(p.numel() for p in chunk.parameters())
    assert plan["model_parameters"] == numel
    assert rank_params(job) == numel  # the memory refusal's count (service/spec/limits.py)
    assert plan["cost"]["fits"] and plan["cost"]["predicted_step_s"] > 0
    # Megatron's MLA FLOPs are 6 per weight (the norms' "+1" included) and token, plus the causal core.
    s = Shapes.of(spec)
    core = 16 * 4 * (8 + 8 + 6) / 2
    assert s.mla.flops_per_token(32, 4, 16) == 6 * (s.mla.parameters(32, 4, 1) + core)
    per_token_layer = s.mla.flops_per_token(32, 4, 16)
    gqa = dataclasses.replace(s, mla=None)
    assert megatron_flops(s, 1) - megatron_flops(gqa, 1) == pytest.approx(
        16 * 2 * (per_token_layer - 12 * 32 * 32 * (1 + 1 + 16 / 32 / 2)), rel=1e-12)


def _shard_numel(rank, world_size, job):
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world_size)
    return sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())


@pytest.mark.slow
def test_plan_counts_two_real_tp_ranks():
    """tp2: the up and output projections split over heads, the down projections and their norms whole."""
    from tests.helpers.ranks import run_ranks

    spec = parse_spec(mla_spec(world=2, parallel={"tensor_model_parallel_size": 2}))
    per_rank = run_ranks(_shard_numel, 2, args=(to_job_config(spec),), timeout_s=300)
    assert [m["parameters"] for m in plan_job(spec)["memory"]] == per_rank


def test_whole_dense_mla_model_matches_deepseek_v3_for_causal_lm():
    """A whole raytron model with MLA (YaRN on) against DeepseekV3ForCausalLM with dense layers only
    (first_k_dense_replace = all layers), weights copied by name: logits, loss and every gradient."""
    from transformers import DeepseekV3ForCausalLM

    from workers.model.decoder import ModelChunk, ShardContext

    torch.manual_seed(0)
    hf = hf_config(16, yarn=True)
    hf.update({"vocab_size": 64, "intermediate_size": 48, "num_hidden_layers": 2, "first_k_dense_replace": 2,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False})
    ref = DeepseekV3ForCausalLM(hf).float()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cfg = dataclasses.replace(our_config(16, yarn=True), num_layers=2, vocab_size=64, ffn_hidden_size=48)
    ours = ModelChunk(cfg, ShardContext(), [0, 1], pre_process=True, post_process=True, positions=torch.arange(16))
    renames = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm", "attention": "self_attn",
               "mlp.down": "mlp.down_proj"}

    def hf_name(name: str) -> str:
        if name.startswith("layers."):
            for a, b in renames.items():
                name = name.replace(f".{a}.", f".{b}.")
            return f"model.{name}"
        return {"embedding.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}[name]

    def hf_tensors(name: str, of) -> torch.Tensor:
        """Our parameter ``name`` from transformers' tensors (``of``: hub name -> tensor)."""
        if name.endswith("mlp.gate_up.weight"):  # [gate; up] in one process
            base = hf_name(name).replace("gate_up.weight", "")
            return torch.cat([of(base + "gate_proj.weight"), of(base + "up_proj.weight")])
        return of(hf_name(name))

    theirs = ref.state_dict()
    ours.load_state_dict({name: hf_tensors(name, theirs.__getitem__) for name, _ in ours.named_parameters()},
                         strict=True)
    tokens = torch.randint(0, 64, (2, 16))
    out = ref(input_ids=tokens, labels=tokens)
    logits = ours(tokens.t().contiguous())  # [s, b, vocab]
    assert rel(logits.detach().transpose(0, 1), out.logits.detach()) < 1e-6
    # transformers' loss predicts token t+1 from position t
    loss = torch.nn.functional.cross_entropy(logits.transpose(0, 1)[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - out.loss.item()) < 1e-6 * out.loss.item()
    loss.backward()
    out.loss.backward()
    hf_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, hf_tensors(name, lambda n: hf_params[n].grad)) < 1e-6, name
