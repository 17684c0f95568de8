"""Hugging Face interop: an exported checkpoint is a LlamaForCausalLM / MixtralForCausalLM
with raytron's logits, and a Hugging Face directory loads into any layout (hf:DIR)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.helpers.parity import job_of, tiny_spec
from tests.helpers.hf import assert_close, hf_logits, raytron_logits  # noqa: F401

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}
LLAMA3ISH = {"rotary_base": 500000.0, "norm_epsilon": 1e-6}  # non-default: the fields must travel


def trainer(model: dict | None = None):
    from workers.train.trainer import Trainer

    return Trainer(job_of(tiny_spec(model={"num_layers": 2, **(model or {})}, training={"train_iters": 5})), 0, 1)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))  # [b, s]


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "mixtral"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, moe):
    from api.cli import export_cmd
    from workers.checkpoint.checkpointer import Checkpointer

    t = trainer({**LLAMA3ISH, **(MOE if moe else {})})
    for _ in range(2):  # trained weights: norms away from 1, moments nonzero
        t.train_step()
    Checkpointer(str(tmp_path / "ckpt")).save(t)
    parser = argparse.ArgumentParser()
    args = parser.add_subparsers(dest="command")
    export_cmd.add_parser(args)
    ns = parser.parse_args(["export", str(tmp_path / "ckpt"), "--format", "hf", str(tmp_path / "hf")])
    assert ns.func(ns) == 0
    name, got = hf_logits(tmp_path / "hf", tokens())
    assert name == ("MixtralForCausalLM" if moe else "LlamaForCausalLM")
    assert_close(got, raytron_logits(t, tokens()))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-6


def test_export_matches_the_safetensors_package(tmp_path):
    from safetensors.torch import load_file

    from workers.checkpoint.checkpointer import Checkpointer
    from workers.hf.export import export_hf

    t = trainer()
    Checkpointer(str(tmp_path / "ckpt")).save(t)
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    loaded = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (chunk,) = t.chunks
    assert torch.equal(loaded["model.embed_tokens.weight"], chunk.embedding.weight.detach())
    assert torch.equal(loaded["lm_head.weight"], chunk.output.weight.detach())
    assert torch.equal(loaded["model.layers.1.mlp.up_proj.weight"], chunk.layers[1].mlp.gate_up.weight.detach()[64:])


def test_export_refuses_a_missing_checkpoint(tmp_path, capsys):
    from api.cli import export_cmd

    ns = argparse.Namespace(checkpoint=str(tmp_path), out_dir=str(tmp_path / "o"), format="hf")
    assert export_cmd.run(ns) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def save_hf(moe: bool, path):
    """A randomly initialised transformers model saved with save_pretrained; returns (moe, path)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=500000.0,
                  tie_word_embeddings=False)
    torch.manual_seed(3)
    if moe:
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return moe, path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf(False, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return save_hf(True, tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(params=["llama_dir", "mixtral_dir"])
def hf_dir(request):
    return request.getfixturevalue(request.param)


def test_hf_import_gives_the_transformers_logits(hf_dir):
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source

    moe, path = hf_dir
    t = trainer({**LLAMA3ISH, **(MOE if moe else {})})
    assert load_checkpoint(t, open_source(f"hf:{path}"))["iteration"] == 0
    assert_close(raytron_logits(t, tokens(1)), hf_logits(path, tokens(1))[1])


def test_hf_import_refuses_another_model(hf_dir):
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source

    moe, path = hf_dir
    with pytest.raises(ValueError, match="model.rotary_base: 500000.0 there, 10000.0 in this job"):
        load_checkpoint(trainer({"norm_epsilon": 1e-6, **(MOE if moe else {})}), open_source(f"hf:{path}"))


@pytest.mark.slow
def test_hf_import_into_tp2_sp_pp2_gives_the_single_process_loss(llama_dir):
    """hf:DIR at tp2 x sp x pp2 (4 ranks): the first iterations' losses are those of one
    process that imported the same directory."""
    from tests.helpers.checkpoints import run
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source

    _, path = llama_dir
    t = trainer(LLAMA3ISH)
    load_checkpoint(t, open_source(f"hf:{path}"))
    want = [t.train_step()["loss"] for _ in range(2)]
    out = run(4, {"tensor_model_parallel_size": 2, "sequence_parallel": True, "pipeline_model_parallel_size": 2},
              {"num_layers": 2, **LLAMA3ISH}, load=f"hf:{path}", until=2)
    for a, b in zip(out[0]["losses"], want):
        assert abs(a - b) <= 1e-5 * abs(b), (out[0]["losses"], want)


@pytest.mark.procs
def test_save_hf_writes_a_transformers_model_of_each_due_checkpoint(tmp_path):
    """checkpoint.save_hf on `raytron run` at tp2: every save_hf_interval-th checkpoint and the last get an
    HF directory under DIR/hf while the job trains, each with the logits of raytron's model at that
    iteration (the checkpoint loaded into one process) in transformers, and checkpoint.hf_tokenizer's files."""
    import os
    import subprocess
    import sys

    import yaml

    from workers.checkpoint.reader import load_checkpoint

    spec = tiny_spec(world=2, model={"num_layers": 2}, parallel={"tensor_model_parallel_size": 2},
                     training={"train_iters": 5})
    from tests.helpers.chat import chat_tokenizer

    tokenizer = chat_tokenizer(tmp_path / "tok", "chatml")
    spec["checkpoint"] = {"save_interval": 1, "dir": str(tmp_path / "ck"), "keep_last": 5, "save_hf": True,
                          "save_hf_interval": 2, "hf_tokenizer": tokenizer}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    p = subprocess.run([os.path.join(os.path.dirname(sys.executable), "raytron"), "run", str(tmp_path / "job.yaml"),
                        "--launcher", "processes", "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path / "ck" / "hf")) == ["iter_0000002", "iter_0000004", "iter_0000005"]
    for it in (2, 5):
        t = trainer()
        load_checkpoint(t, str(tmp_path / "ck" / f"iter_{it:07d}"))
        name, got = hf_logits(tmp_path / "ck" / "hf" / f"iter_{it:07d}", tokens())
        assert name == "LlamaForCausalLM"
        assert_close(got, raytron_logits(t, tokens()))
    from transformers import AutoTokenizer  # the copy is a whole model directory: tokenizer included

    copied = AutoTokenizer.from_pretrained(str(tmp_path / "ck" / "hf" / "iter_0000005"))
    original = AutoTokenizer.from_pretrained(tokenizer)
    assert copied.get_vocab() == original.get_vocab() and copied.chat_template == original.chat_template
