"""Qwen2 and Qwen3 against transformers: tiny random models built with transformers' own config
classes and saved with save_pretrained. ``model: {from_hf: DIR}`` takes the architecture from
the directory; ``hf:DIR`` then gives transformers' logits, loss and every gradient, and its
first loss at tp2 (x pp2 for the tied Qwen2, x sp for Qwen3); an exported trained checkpoint
loads in transformers as the same class with raytron's logits.

The two models cover every attention variant: Qwen2 has the QKV bias and a tied output layer,
Qwen3 the q/k norms, a head dimension of 16 where hidden / heads is 8 (kv_channels), and an
untied output layer."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.helpers.parity import job_of, tiny_spec
from tests.helpers.hf import assert_close, hf_logits, raytron_logits
from tests.helpers.hf import assert_first_loss_is_transformers, assert_same_grads, export_hf, imported_grads_against_transformers, spec, trainer  # noqa: F401

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0)


def save_qwen(kind: str, path):
    """A random Qwen2 (tied) or Qwen3 (head_dim 16, untied, saved as sharded safetensors with an
    index) model, norms and biases away from their init (so a swapped norm or a dropped bias
    would show)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **COMMON))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **COMMON))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(path), **({"max_shard_size": "40KB"} if kind == "qwen3" else {}))
    assert (path / "model.safetensors.index.json").exists() == (kind == "qwen3")
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {kind: save_qwen(kind, tmp_path_factory.mktemp(kind)) for kind in ("qwen2", "qwen3")}


@pytest.fixture(params=["qwen2", "qwen3"])
def qwen(request, saved):
    return request.param, saved[request.param]


def test_from_hf_fills_the_architecture(qwen):
    kind, path = qwen
    m = job_of(spec(path)).model
    assert (m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size, m.vocab_size) == (32, 4, 2, 64, 256)
    assert (m.rotary_base, m.norm_epsilon, m.seq_length) == (1000000.0, 1e-6, 16)  # seq_length: the spec's
    want = {"qwen2": (True, False, None, False), "qwen3": (False, True, 16, True)}[kind]
    assert (m.add_qkv_bias, m.qk_layernorm, m.kv_channels, m.untie_embeddings_and_output_weights) == want


def test_from_hf_refuses_a_field_that_disagrees(qwen, tmp_path):
    from service.spec.spec import parse_spec

    kind, path = qwen
    with pytest.raises(ValueError, match=r"model\.num_attention_heads: 8 in the spec, 4 in model\.from_hf .*"
                                         r"remove model\.num_attention_heads \(from_hf fills it\)"):
        parse_spec(spec(path, num_attention_heads=8))
    flag = {"qwen2": "add_qkv_bias", "qwen3": "qk_layernorm"}[kind]
    with pytest.raises(ValueError, match=rf"model\.{flag}: False in the spec, True"):
        parse_spec(spec(path, **{flag: False}))
    parse_spec(spec(path, num_attention_heads=4, kv_channels=16 if kind == "qwen3" else 8))  # agreeing: fine
    with pytest.raises(ValueError, match="model.from_hf: .*config.json does not exist"):
        parse_spec(spec(tmp_path))


def test_a_disagreeing_field_is_refused_by_the_cli_and_the_http_api(saved, tmp_path):
    """Exit 2 with one line from ``raytron run``, and a 422 naming the field from a real server."""
    from tests.helpers.server import Server
    from tests.helpers.cli import run_refused, spec_file

    path = saved["qwen3"]
    line = run_refused(spec_file(tmp_path, model={"from_hf": str(path), "num_attention_heads": 8}))
    assert "model.num_attention_heads: 8 in the spec, 4 in model.from_hf" in line, line
    srv = Server(tmp_path / "srv").start()
    try:
        with srv.client() as api:
            r = api.post("/jobs", json=spec(path, vocab_size=512))
        assert r.status_code == 422, r.text
        (entry,) = r.json()["errors"]
        assert entry["field"] == "model.vocab_size" and "512 in the spec, 256 in model.from_hf" in entry["message"]
    finally:
        srv.stop()
        srv.kill_runners()


def test_hf_import_gives_transformers_logits_loss_and_every_gradient(qwen):
    """Logits, loss and the gradient of every parameter (each raytron tensor split into Hugging
    Face's names) against transformers, on one sequence batch."""
    kind, path = qwen
    _, got, want_grads = imported_grads_against_transformers(path)
    if kind == "qwen2":  # tied: transformers has no lm_head parameter of its own
        assert "lm_head.weight" not in got
    assert_same_grads(got, want_grads)


def test_a_tied_model_loads_into_an_untied_job_and_not_the_reverse(saved):
    """Qwen2's tied table starts both the embedding and the output layer of an untied job; an
    untied Qwen3 into a tied job is refused, naming the field."""
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source
    from workers.train.trainer import Trainer

    def job(**model):
        return Trainer(job_of(tiny_spec(model={"num_layers": 2, "rotary_base": 1000000.0, "norm_epsilon": 1e-6,
                                               **model})), 0, 1)

    t = job(add_qkv_bias=True)
    load_checkpoint(t, open_source(f"hf:{saved['qwen2']}"))
    assert torch.equal(t.chunks[0].output.weight, t.chunks[0].embedding.weight)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    assert_close(raytron_logits(t, ids), hf_logits(saved["qwen2"], ids)[1])
    t = job(qk_layernorm=True, kv_channels=16, untie_embeddings_and_output_weights=False)
    with pytest.raises(ValueError, match="model.untie_embeddings_and_output_weights: True there, False in this job"):
        load_checkpoint(t, open_source(f"hf:{saved['qwen3']}"))


def test_hf_import_at_tp2_gives_the_transformers_first_loss(qwen):
    """hf:DIR at tp2 (x pp2 for the tied Qwen2: the embedding and its last-stage copy both
    come from embed_tokens; x sp for Qwen3): the first loss is transformers' on that batch."""
    kind, path = qwen
    parallel = {"qwen2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
                "qwen3": {"tensor_model_parallel_size": 2, "sequence_parallel": True}}[kind]
    assert_first_loss_is_transformers(path, 4 if kind == "qwen2" else 2, parallel)


def test_export_of_a_trained_checkpoint_loads_as_the_same_class(qwen, tmp_path):
    from workers.checkpoint.checkpointer import Checkpointer

    kind, path = qwen
    t = trainer(path)
    for _ in range(2):  # trained weights: biases and norms moved by the optimizer
        t.train_step()
    Checkpointer(str(tmp_path / "ckpt")).save(t)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    name, got = hf_logits(tmp_path / "hf", ids)
    assert name == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    assert_close(got, raytron_logits(t, ids))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] == (kind == "qwen2") and config["head_dim"] == (16 if kind == "qwen3" else 8)
