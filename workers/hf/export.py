"""``raytron export --format hf``: a raytron checkpoint as a Hugging Face model directory.

Reads the full (logical) tensors through :class:`workers.checkpoint.reader.CheckpointReader` and
writes them under Hugging Face's names (:func:`workers.hf.interop.to_hf`), so transformers
loads the result as the class of its family (:mod:`workers.hf.families`: Llama, Mixtral, Qwen2,
Qwen3, Qwen3-MoE, DeepSeek-V3).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from workers.checkpoint.layout import Box
from workers.checkpoint.reader import CheckpointReader
from workers.hf.interop import hf_config, logical_shapes, to_hf


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def export_hf(checkpoint: str, out_dir: str, tokenizer: str | None = None) -> dict:
    """Write a raytron checkpoint (a directory, or the latest under a root) as a Hugging Face
    model directory: ``model.safetensors`` (float32) and ``config.json``, and with ``tokenizer`` (a
    directory) its tokenizer files (:data:`TOKENIZER_FILES` that it has).

    Returns:
        ``{"iteration", "architecture", "bytes", "path", "mtp_layers_left_out"}`` (MTP modules of
        a family without MTP keys: every family but DeepSeek-V3).
    """
    reader = CheckpointReader.open(checkpoint)
    reader.verify()  # every byte against the manifest before it leaves raytron
    m = reader.model
    config = hf_config(m)  # refuses a model no family expresses before anything is read
    dropped = 0
    if config["model_type"] != "deepseek_v3" and m.get("mtp_num_layers"):
        # only DeepSeek-V3 has MTP keys (workers/hf/mtp.py): the main model goes without them
        dropped, m = m["mtp_num_layers"], {**m, "mtp_num_layers": None}
    tensors, storages = {}, set()
    # every DeepSeek-V3 router has a bias: a sigmoid router without one writes zeros
    shapes = logical_shapes({**m, "moe_router_enable_expert_bias": config["model_type"] == "deepseek_v3"})
    for name, shape in shapes.items():
        key = f"model/{name}"
        if reader.has(key) or not name.endswith("router.expert_bias"):
            full = reader.read(key, Box((0,) * len(shape), shape))
        else:
            full = torch.zeros(shape)
        tensors.update({k: _own(v, storages) for k, v in to_hf(name, full, m).items()})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.safetensors"
    save_file(tensors, path, {"format": "pt", "raytron_iteration": str(reader.iteration)})
    size = path.stat().st_size
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = [name for name in TOKENIZER_FILES if tokenizer and (Path(tokenizer) / name).is_file()]
    for name in copied:
        shutil.copyfile(Path(tokenizer) / name, out / name)
    return {"iteration": reader.iteration, "architecture": config["architectures"][0], "bytes": size, "path": str(out),
            "mtp_layers_left_out": dropped, "tokenizer_files": copied}


def _own(t: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """``t`` contiguous on the CPU in memory of its own (a clone unless it already is), so that
    ``save_file`` takes every tensor whatever it is a view of: it refuses non-contiguous tensors
    and tensors whose memory overlaps (gate_up's halves and the experts are views of one tensor)."""
    t = t.detach().cpu().contiguous()
    storage = t.untyped_storage()
    whole = t.storage_offset() == 0 and t.numel() * t.element_size() == storage.nbytes()
    if not whole or storage.data_ptr() in storages:
        t = t.clone()
    storages.add(t.untyped_storage().data_ptr())
    return t
