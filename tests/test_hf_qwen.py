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

from tests.parity import job_of, tiny_spec
from tests.test_hf_interop import assert_close, hf_logits, raytron_logits

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
GRAD_RTOL = 2e-6  # ~1e-6: float32 noise through two layers (k_norm sees 1.0e-6)
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


def spec(path, world: int = 1, parallel: dict | None = None, **model) -> dict:
    # tiny_spec's 4 layers are the only architecture field it gives that the models do not share
    s = tiny_spec(world=world, parallel=parallel, training={"train_iters": 2})
    for k in ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        s["model"].pop(k)  # from_hf fills them
    s["model"].update({"num_layers": 2, "from_hf": str(path), **model})
    return s


def trainer(path):
    from workers.train.trainer import Trainer

    return Trainer(job_of(spec(path)), 0, 1)


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
    from tests.test_api import Server
    from tests.test_cli_bad_input import run_refused, spec_file

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


def loss_and_grads_transformers(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def imported_grads_against_transformers(path) -> tuple:
    """A one-process job importing ``hf:path``: its logits and loss on one batch checked against
    transformers' (loss to 1e-6), then its gradient in Hugging Face's names (each raytron tensor's
    logical view split by ``to_hf``) beside transformers' own. Returns ``(trainer, got, want)``."""
    from workers.checkpoint.layout import param_views
    from workers.checkpoint.reader import load_checkpoint
    from workers.hf.interop import open_source
    from workers.hf.interop import to_hf

    t = trainer(path)
    load_checkpoint(t, open_source(f"hf:{path}"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert_close(raytron_logits(t, ids), hf_logits(path, ids)[1])
    want_loss, want_grads = loss_and_grads_transformers(path, ids)
    (chunk,) = t.chunks
    t.optimizer.zero_grad()
    logits = chunk(ids.t())[:-1].transpose(0, 1)  # [s, b, V] -> [b, s - 1, V], as transformers' below
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    assert abs(loss.item() - want_loss) <= 1e-6 * want_loss
    m = {k: getattr(t.job.model, k) for k in t.job.model.__dataclass_fields__}
    got = {}
    for v in param_views(t):  # the logical tensors (gate_up as [2, F, h]), then Hugging Face's names
        got.update(to_hf(v.name, v.logical(v.param.grad), m))
    return t, got, want_grads


def assert_same_grads(got: dict, want: dict) -> None:
    """The same names, and each gradient within GRAD_RTOL of transformers' (relative to its max)."""
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    for name, w in want.items():
        err = float((got[name] - w).abs().max() / w.abs().max())
        assert err <= GRAD_RTOL, f"gradient of {name}: relative error {err:.2e}"


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


def first_batch_loss_transformers(path, job) -> float:
    """transformers' mean loss over iteration 0's global batch (the trainer's sampler)."""
    from transformers import AutoModelForCausalLM

    from workers.data.dataset import GlobalSampler

    t = job.training
    tokens, labels = GlobalSampler(t.data, job.model.seq_length, t.seed, t.global_batch_size, split=t.split).batch(
        0, 0, t.global_batch_size)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))


def assert_first_loss_is_transformers(path, world: int, parallel: dict) -> None:
    """A job importing ``hf:path`` on ``world`` ranks of ``parallel`` trains one iteration; its loss
    is transformers' on the same global batch (1e-5 relative)."""
    from tests.test_checkpoint_reshard import train_ranks
    from tests.helpers.ranks import run_ranks

    job = job_of(spec(path, world=world, parallel=parallel))
    out = run_ranks(train_ranks, world, args=(job,), kwargs={"load": f"hf:{path}", "until": 1}, timeout_s=600)
    want = first_batch_loss_transformers(path, job)
    assert abs(out[0]["losses"][0] - want) <= 1e-5 * want, (out[0]["losses"], want)


def export_hf(checkpoint, out) -> None:
    """``raytron export CHECKPOINT --format hf OUT`` through the CLI's own parser; it must succeed."""
    from api.cli import export_cmd

    parser = argparse.ArgumentParser()
    export_cmd.add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["export", str(checkpoint), "--format", "hf", str(out)])
    assert ns.func(ns) == 0


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
