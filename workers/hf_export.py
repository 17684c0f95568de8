"""``raytron export --format hf``: a raytron checkpoint as a Hugging Face model directory.

Reads the full (logical) tensors through :class:`workers.checkpoint_reader.CheckpointReader` and
writes them under Hugging Face's names (:func:`workers.hf_interop.to_hf`), so transformers
loads the result as ``LlamaForCausalLM`` or ``MixtralForCausalLM``.
"""

from __future__ import annotations

import json
from pathlib import Path

from workers.checkpoint_layout import Box
from workers.checkpoint_reader import CheckpointReader
from workers.hf_interop import hf_config, logical_shapes, to_hf
from workers.safetensors_io import save_file


def export_hf(checkpoint: str, out_dir: str) -> dict:
    """Write a raytron checkpoint (a directory, or the latest under a root) as a Hugging Face
    model directory: ``model.safetensors`` (float32) and ``config.json``.

    Returns:
        ``{"iteration", "architecture", "bytes", "path"}``.
    """
    reader = CheckpointReader.open(checkpoint)
    reader.verify()  # every byte against the manifest before it leaves raytron
    m = reader.model
    tensors = {}
    for name, shape in logical_shapes(m).items():
        full = reader.read(f"model/{name}", Box((0,) * len(shape), shape))
        tensors.update({k: v.contiguous() for k, v in to_hf(name, full, m).items()})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    size = save_file(tensors, out / "model.safetensors", {"raytron_iteration": str(reader.iteration)})
    config = hf_config(m)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"iteration": reader.iteration, "architecture": config["architectures"][0], "bytes": size, "path": str(out)}
