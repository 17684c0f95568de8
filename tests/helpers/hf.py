"""Hugging Face models beside raytron's: tiny checkpoints written by transformers, logits and gradients from both, exports through the CLI."""

from __future__ import annotations

import argparse

import torch

from tests.helpers.parity import job_of, tiny_spec

LOGITS_RTOL = 1e-5


@torch.no_grad()
def raytron_logits(t, ids: torch.Tensor) -> torch.Tensor:
    (chunk,) = t.chunks
    out = chunk(ids.t())
    logits = out[0] if isinstance(out, tuple) else out  # (logits, hidden) with MTP
    return logits.transpose(0, 1)  # [s, b, V] -> [b, s, V]


@torch.no_grad()
def hf_logits(directory, ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    return type(model).__name__, model(ids).logits


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= LOGITS_RTOL, f"logits differ: relative error {err:.2e}"


GRAD_RTOL = 2e-6  # ~1e-6: float32 noise through two layers (k_norm sees 1.0e-6)


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
    from workers.hf.interop import open_source, to_hf

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
    from tests.helpers.checkpoints import train_ranks
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


MLA = {"multi_latent_attention": True, "num_query_groups": None, "q_lora_rank": 16, "kv_lora_rank": 12,
       "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 6, "rotary_scaling_factor": 4.0, "mscale": 0.9,
       "mscale_all_dim": 0.7, "original_max_position_embeddings": 8, "beta_fast": 4.0, "beta_slow": 1.0}
