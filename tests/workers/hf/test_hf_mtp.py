"""DeepSeek-V3's MTP weights through Hugging Face files (workers/hf/mtp.py): an MTP model trained a
step exports its MTP module under DeepSeek-V3's keys (layer N: enorm, hnorm, eh_proj,
shared_head.norm, the layer's own keys, and copies of the shared embedding and head), transformers
loads the main model from the same directory, and ``hf:DIR`` reads every tensor back bit for bit into
an MTP job (every parameter bit-equal to the exporter's). Without the weights (transformers'
save_pretrained keeps num_nextn_predict_layers but drops them) an MTP job is refused naming the
tensor, and another family's export leaves the modules out and says so."""

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.hf import MLA, assert_close, hf_logits, raytron_logits, spec
from tests.helpers.parity import V3_MODEL, job_of, tiny_spec

DSV3_MTP = {**MLA, **V3_MODEL, "norm_epsilon": 1e-6, "moe_router_load_balancing_type": "aux_loss",
            "moe_shared_expert_intermediate_size": 48,
            "mtp_num_layers": 1, "num_layers": 4}


def _saved(tmp_path, model):
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.train.trainer import Trainer

    t = Trainer(job_of(tiny_spec(model=model)), 0, 1)
    t.train_step()
    Checkpointer(str(tmp_path / "ckpt")).save(t)
    return t


def test_mtp_weights_export_under_deepseek_v3_keys_and_import_back_exactly(tmp_path):
    from workers.checkpoint.layout import Box
    from workers.checkpoint.reader import CheckpointReader, load_checkpoint
    from workers.hf.export import export_hf
    from workers.hf.interop import open_source
    from workers.train.trainer import Trainer

    t = _saved(tmp_path, DSV3_MTP)
    result = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert result["architecture"] == "DeepseekV3ForCausalLM" and result["mtp_layers_left_out"] == 0
    files = load_file(tmp_path / "hf" / "model.safetensors")
    n = DSV3_MTP["num_layers"]
    chunk = t.chunks[0]
    mtp = chunk.mtp.layers[0]
    for key, param in [("enorm.weight", mtp.enorm.weight), ("hnorm.weight", mtp.hnorm.weight),
                       ("eh_proj.weight", mtp.eh_proj.weight), ("shared_head.norm.weight", mtp.final_norm.weight),
                       ("shared_head.head.weight", chunk.output.weight), ("embed_tokens.weight", chunk.embedding.weight),
                       ("input_layernorm.weight", mtp.layer.input_norm.weight),
                       ("self_attn.kv_a_proj_with_mqa.weight", mtp.layer.attention.kv_a_proj_with_mqa.weight),
                       ("mlp.gate.weight", mtp.layer.mlp.router.weight)]:
        assert torch.equal(files[f"model.layers.{n}.{key}"], param.detach()), key
    assert any(k.startswith(f"model.layers.{n}.mlp.experts.") for k in files)
    import json

    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    name, want = hf_logits(tmp_path / "hf", ids)  # transformers reads the main model, ignoring layer N
    assert name == "DeepseekV3ForCausalLM"
    assert_close(raytron_logits(t, ids), want)

    source, saved = open_source(f"hf:{tmp_path / 'hf'}"), CheckpointReader.open(str(tmp_path / "ckpt"))
    mtp_keys = [k for k in source.shapes if k.startswith("mtp.")]
    assert len(mtp_keys) > 10
    for name in source.shapes:
        if name.endswith("expert_bias"):
            continue
        box = Box((0,) * len(source.shapes[name]), source.shapes[name])
        assert torch.equal(source.read(f"model/{name}", box), saved.read(f"model/{name}", box)), name

    back = Trainer(job_of(spec(tmp_path / "hf", mtp_num_layers=1, num_layers=n)), 0, 1)
    load_checkpoint(back, source)
    for (name, p, _), (_, q, _) in zip(back.chunks[0].logical_parameters(), t.chunks[0].logical_parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def test_an_mtp_job_refuses_a_directory_without_mtp_weights(tmp_path):
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.export import export_hf
    from workers.hf.interop import open_source
    from workers.train.trainer import Trainer

    _saved(tmp_path, {**DSV3_MTP, "mtp_num_layers": None})
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    back = Trainer(job_of(spec(tmp_path / "hf", mtp_num_layers=1, num_layers=DSV3_MTP["num_layers"])), 0, 1)
    with pytest.raises(ValueError, match="has no weight 'mtp.layers.0"):
        load_checkpoint(back, open_source(f"hf:{tmp_path / 'hf'}"))


def test_a_family_without_mtp_keys_exports_the_main_model_and_says_so(tmp_path, capsys):
    from tests.helpers.hf import export_hf

    _saved(tmp_path, {"mtp_num_layers": 2})
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert "left out the 2 MTP module(s): LlamaForCausalLM has no MTP weights" in capsys.readouterr().out
    assert not [k for k in load_file(tmp_path / "hf" / "model.safetensors") if "eh_proj" in k]
