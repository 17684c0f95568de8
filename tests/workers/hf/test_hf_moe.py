"""workers.hf.moe against tiny random Qwen3-MoE and DeepSeek-V3 models saved by transformers:
the config's MoE fields pick the same MoE layers, the tensor names cover every MoE tensor of the
checkpoint, and the MoE layer built from them computes what transformers' layer computes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from workers.config import ModelConfig
from workers.hf.moe import hf_moe_config, hf_moe_names, moe_fields_from_hf
from workers.model.decoder import ShardContext
from workers.model.layer import moe_layer

transformers = pytest.importorskip("transformers")
H = 16


def _saved(model, tmp_path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path)
    tensors = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _check(hf_model, tmp_path, moe_class):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0, 0.3)
        for layer in hf_model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.normal_(0, 0.1)
    tensors = _saved(hf_model, tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    fields = moe_fields_from_hf(c)
    want_moe = [int(isinstance(layer.mlp, moe_class)) for layer in hf_model.model.layers]
    assert fields["moe_layer_freq"] == want_moe and 0 in want_moe and 1 in want_moe
    cfg = ModelConfig(num_layers=c["num_hidden_layers"], hidden_size=H, num_attention_heads=2, num_query_groups=2,
                      ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"], seq_length=8,
                      **{**fields, "moe_layer_freq": tuple(fields["moe_layer_freq"])})
    # The export keys give back the same config values.
    for key, value in hf_moe_config(dataclasses.asdict(cfg)).items():
        assert (c[key] if key == "architectures" else getattr(hf_model.config, key)) == value, (key, value)
    x = torch.randn(3, 5, H)  # [b, s, h]
    for i, layer in enumerate(hf_model.model.layers):
        if not want_moe[i]:
            continue
        ours, used = moe_layer(cfg, ShardContext(), f"layers.{i}.mlp"), set()
        for local, t in [*ours.named_parameters(), *ours.named_buffers()]:
            names = hf_moe_names(f"layers.{i}.mlp.{local}", cfg.num_moe_experts)
            if names is None:
                assert local == "router.tokens_per_expert"
                continue
            used.update(names)
            with torch.no_grad():
                t.copy_(torch.stack([tensors[n] for n in names]).reshape(t.shape) if len(names) > 1
                        else tensors[names[0]])
        assert used == {n for n in tensors if n.startswith(f"model.layers.{i}.mlp.")}
        with torch.no_grad():
            want = layer.mlp(x)
            got = ours(x.transpose(0, 1))[0].transpose(0, 1)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_qwen3_moe_fields_names_and_layer(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=H, intermediate_size=40, moe_intermediate_size=12,
                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1,
                         mlp_only_layers=[0, 2])
    _check(Qwen3MoeForCausalLM(cfg).float(), tmp_path, Qwen3MoeSparseMoeBlock)


def test_deepseek_v3_fields_names_and_layer(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(vocab_size=32, hidden_size=H, intermediate_size=40, moe_intermediate_size=12,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
                           q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                           n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                           routed_scaling_factor=2.5, first_k_dense_replace=1)
    _check(DeepseekV3ForCausalLM(cfg).float(), tmp_path, DeepseekV3MoE)


@pytest.mark.parametrize("config,needle", [
    ({"model_type": "deepseek_v3", "norm_topk_prob": False}, "norm_topk_prob: false"),
    ({"model_type": "deepseek_v3", "num_experts_per_tok": 6, "topk_group": 2}, "best 2 scores"),
    ({"model_type": "mixtral"}, "model_type 'mixtral'"),
])
def test_unsupported_hf_routing_is_refused(config, needle):
    base = {"num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 8, "n_group": 4, "topk_group": 4,
            "moe_intermediate_size": 12}
    with pytest.raises(ValueError, match=needle):
        moe_fields_from_hf({**base, **config})
