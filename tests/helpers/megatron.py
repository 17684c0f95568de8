"""megatron-core beside raytron: its own GPTModel on CPU (gloo, fp32), saved and loaded by its own
``dist_checkpointing``, as the outside judge of ``checkpoint.load: megatron:DIR`` and ``raytron export
--format megatron``.

megatron-core runs on CPU with three CUDA calls given CPU stand-ins, its save a plain results queue (``torch.cuda.current_device``,
``torch.cuda.synchronize``, the CUDA RNG tracker's ``fork``), a placeholder for its triton-only
``paged_stash`` ops module, and a causal mask passed in (its default one is made on CUDA). Every
function that needs a process group is a rank function for :func:`tests.helpers.ranks.run_ranks`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import queue
import sys
import types
from pathlib import Path

import torch

# The tiny model of these tests (raytron's ModelConfig names). init std 0.2: at 0.02 a gate/up swap
# moves the loss by ~3e-5 only.
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 96, "vocab_size": 128, "seq_length": 16}
STD = 0.2
# Megatron-LM's arguments of MODEL as its pretrain_gpt.py keeps them in the checkpoint
ARGS = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
        "group_query_attention": True, "num_query_groups": 2, "kv_channels": 16, "padded_vocab_size": 128,
        "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False, "position_embedding_type": "rope",
        "rotary_base": 10000, "rotary_percent": 1.0, "norm_epsilon": 1e-5,
        "untie_embeddings_and_output_weights": True, "seq_length": 16}
PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _placeholder_attr(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return lambda *a, **k: None


def stand_ins() -> None:
    """The CPU stand-ins megatron-core needs (idempotent); call before importing megatron.core (a test
    module: then ``pytest.importorskip("megatron.core")``)."""
    torch.cuda.current_device = lambda: "cpu"  # used as a device: the tensor goes to the CPU
    torch.cuda.synchronize = lambda *a, **k: None
    if importlib.util.find_spec("triton") is None and PAGED_STASH not in sys.modules:
        mod = types.ModuleType(PAGED_STASH)  # its triton kernels, for MoE paged stashing: never called here
        mod.__getattr__ = _placeholder_attr
        sys.modules[PAGED_STASH] = mod
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return  # not installed: the tests importorskip it
    mrandom.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
    # its save collects the writer threads' results through a spawned Manager's queue, which a
    # (daemonic) rank process may not start; the save runs in this process, so a plain queue does
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def init_parallel(tp: int = 1, pp: int = 1) -> None:
    """megatron-core's parallel state over the already-initialised (gloo) default group."""
    stand_ins()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def gpt_model(model: dict | None = None, *, seed: int = 1, sequence_parallel: bool = False):
    """megatron-core's GPTModel (local layer spec, fp32, CPU) of this rank's stage, of raytron model
    fields ``model`` (Llama-style: RMSNorm, SwiGLU, RoPE, no biases, untied unless told)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = {**MODEL, **(model or {})}
    torch.manual_seed(seed)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_query_groups=m["num_query_groups"], ffn_hidden_size=m["ffn_hidden_size"],
        kv_channels=m.get("kv_channels"), normalization="RMSNorm", layernorm_epsilon=m.get("norm_epsilon", 1e-5),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=STD, use_cpu_initialization=True,
        params_dtype=torch.float32, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, **_moe(m))
    spec = get_gpt_layer_local_spec(num_experts=m.get("num_moe_experts"), moe_grouped_gemm=False, normalization="RMSNorm")
    gpt = GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=m["vocab_size"], max_sequence_length=m["seq_length"],
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=not m.get("untie_embeddings_and_output_weights", True),
                    position_embedding_type="rope", rotary_base=int(m.get("rotary_base", 10000)))
    with torch.no_grad():  # norms away from 1 (the same on every tp rank), so a swapped norm shows
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return gpt


def _moe(m: dict) -> dict:
    """megatron-core's MoE fields of raytron model fields ``m`` (Mixtral routing, dropless, no aux loss)."""
    if not m.get("num_moe_experts"):
        return {}
    return {"num_moe_experts": m["num_moe_experts"], "moe_router_topk": m["moe_router_topk"],
            "moe_ffn_hidden_size": m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"], "moe_aux_loss_coeff": 0.0,
            "moe_router_load_balancing_type": "none", "moe_token_dispatcher_type": "allgather"}


@torch.no_grad()
def mcore_loss(model, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """A one-stage GPTModel's mean LM loss on ``tokens`` / ``labels`` ``[b, s]``."""
    b, s = tokens.shape
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True = masked
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    model.eval()
    return float(model(tokens, pos, mask, labels=labels).float().mean())


def save_rank(rank, world_size, root: str, model: dict | None = None, tp: int = 1, pp: int = 1, *,
              args: dict | None = None, batch=None) -> float | None:
    """A rank function: build megatron-core's GPTModel at ``tp`` x ``pp`` and save it with its own
    ``dist_checkpointing.save`` (torch_dist) as Megatron-LM lays a checkpoint out: ``root/iter_0000005``
    and ``root/latest_checkpointed_iteration.txt``, the model's state under ``model`` and, with
    ``args``, Megatron-LM's ``args`` namespace in the common state. Returns its loss on ``batch``
    (tokens, labels), at pp 1."""
    init_parallel(tp, pp)
    from megatron.core import dist_checkpointing

    gpt = gpt_model(model)
    ckpt_dir = Path(root) / "iter_0000005"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {"model": gpt.sharded_state_dict(), "iteration": 5, "checkpoint_version": 3.0}
    if args is not None:  # as Megatron-LM keeps them: torch dtypes and megatron-core enums among them
        from megatron.core.transformer.enums import AttnBackend

        state["args"] = argparse.Namespace(**args, params_dtype=torch.float32, attention_backend=AttnBackend.auto)
    dist_checkpointing.save(state, str(ckpt_dir))
    if rank == 0:
        (Path(root) / "latest_checkpointed_iteration.txt").write_text("5")
    return mcore_loss(gpt, *batch) if batch is not None else None


def load_rank(rank, world_size, ckpt_dir: str, model: dict | None = None, tp: int = 1, batch=None) -> dict:
    """A rank function: megatron-core's GPTModel at ``tp`` loads ``ckpt_dir`` (the ``model`` part of a
    Megatron-LM checkpoint) with its own ``dist_checkpointing.load``, strict (every key it asks for
    is there; the checkpoint has no other key but the optimizer's), then ``load_state_dict(strict=True)``;
    returns its ``loss`` on ``batch`` (tokens, labels), and at tp 1 its ``logits``, and the checkpoint's
    ``args`` as a dict."""
    init_parallel(tp, 1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    # Megatron-LM's checkpointing lets torch.load build its args namespace (torch >= 2.6 loads weights only)
    torch.serialization.add_safe_globals([argparse.Namespace])
    gpt = gpt_model(model, seed=99)  # other weights than any checkpoint's
    # megatron-core's names: ``unexpected``, asked for and not in the checkpoint; ``missing``, the other way
    state, missing, unexpected = dist_checkpointing.load({"model": gpt.sharded_state_dict()}, ckpt_dir,
                                                         strict=StrictHandling.RETURN_ALL)
    assert not unexpected and all(k.startswith("optimizer.state.") for k in missing), (missing, unexpected)
    gpt.load_state_dict(state["model"], strict=True)
    out = {"loss": mcore_loss(gpt, *batch), "args": vars(state.get("args") or argparse.Namespace())}
    if tp == 1:
        out["logits"] = mcore_logits(gpt, batch[0])
    return out


@torch.no_grad()
def mcore_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """A one-stage, tp-1 GPTModel's logits ``[b, s, V]``."""
    b, s = tokens.shape
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    model.eval()
    return model(tokens, torch.arange(s).unsqueeze(0).expand(b, s), mask)
