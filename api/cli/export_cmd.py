"""``raytron export CHECKPOINT --format hf|megatron OUT_DIR``: a checkpoint as a Hugging Face model or
a Megatron-Core torch_dist checkpoint.

CHECKPOINT is one checkpoint directory (``.../iter_0000010``) or a checkpoint root (its latest
complete checkpoint), a path or a URI. ``hf``: the output loads with
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` as ``LlamaForCausalLM`` (dense)
or ``MixtralForCausalLM`` (MoE). ``megatron``: OUT_DIR is a Megatron-LM ``--save`` root that
megatron-core's ``dist_checkpointing.load`` and Megatron-LM's ``--load OUT_DIR --ckpt-format torch_dist``
read (:mod:`workers.checkpoint.megatron_export`). Wire it with ``export_cmd.add_parser(subparsers)``; the
parser's ``func`` is :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory or a Megatron-Core checkpoint",
        description="Write a raytron checkpoint as a Hugging Face model (safetensors + config.json) or as a "
                    "Megatron-Core torch_dist checkpoint (a Megatron-LM --save root).",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its latest complete one)")
    p.add_argument("--format", choices=["hf", "megatron"], default="hf", help="output format (hf: LlamaForCausalLM / "
                   "MixtralForCausalLM; megatron: Megatron-Core torch_dist, dense models)")
    p.add_argument("out_dir", help="where to write model.safetensors and config.json (hf), or "
                   "latest_checkpointed_iteration.txt and iter_NNNNNNN/ (megatron)")
    p.add_argument("--tokenizer", metavar="DIR", help="also copy this directory's tokenizer files (tokenizer.json, "
                   "tokenizer_config.json, ...) into the model directory")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Export; 0 on success, 2 with one line on stderr for a bad checkpoint or path."""
    megatron = getattr(args, "format", "hf") == "megatron"
    if megatron and getattr(args, "tokenizer", None):
        print("raytron export: error: --tokenizer is for --format hf (a Megatron-LM checkpoint holds no tokenizer "
              "files; give Megatron-LM its --tokenizer-model)", file=sys.stderr)
        return 2
    try:
        if megatron:
            from workers.checkpoint.megatron_export import export_megatron

            result = export_megatron(args.checkpoint, args.out_dir)
        else:
            from workers.hf.export import export_hf

            result = export_hf(args.checkpoint, args.out_dir, tokenizer=getattr(args, "tokenizer", None))
    except (ValueError, OSError) as e:
        print(f"raytron export: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(result))
    elif megatron:
        print(f"exported iteration {result['iteration']} as a Megatron-Core torch_dist checkpoint to {result['path']} "
              f"({result['tensors']} tensors, {result['bytes'] / 2**20:.1f} MiB)")
    else:
        print(f"exported iteration {result['iteration']} as {result['architecture']} to {result['path']} "
              f"({result['bytes'] / 2**20:.1f} MiB)")
        if result.get("mtp_layers_left_out"):
            print(f"left out the {result['mtp_layers_left_out']} MTP module(s): {result['architecture']} has no MTP "
                  f"weights (DeepSeek-V3 does)")
    return 0
