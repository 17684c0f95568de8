"""``raytron export CHECKPOINT --format hf OUT_DIR``: a checkpoint as a Hugging Face model.

CHECKPOINT is one checkpoint directory (``.../iter_0000010``) or a checkpoint root (its latest
complete checkpoint), a path or a URI. The output loads with
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` as ``LlamaForCausalLM`` (dense)
or ``MixtralForCausalLM`` (MoE). Wire it with ``export_cmd.add_parser(subparsers)``; the
parser's ``func`` is :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write a checkpoint as a Hugging Face model directory",
        description="Write a raytron checkpoint as a Hugging Face model (safetensors + config.json).",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its latest complete one)")
    p.add_argument("--format", choices=["hf"], default="hf", help="output format (hf: LlamaForCausalLM / "
                   "MixtralForCausalLM)")
    p.add_argument("out_dir", help="where to write model.safetensors and config.json")
    p.add_argument("--tokenizer", metavar="DIR", help="also copy this directory's tokenizer files (tokenizer.json, "
                   "tokenizer_config.json, ...) into the model directory")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Export; 0 on success, 2 with one line on stderr for a bad checkpoint or path."""
    from workers.hf.export import export_hf

    try:
        result = export_hf(args.checkpoint, args.out_dir, tokenizer=getattr(args, "tokenizer", None))
    except (ValueError, OSError) as e:
        print(f"raytron export: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps(result))
    else:
        print(f"exported iteration {result['iteration']} as {result['architecture']} to {result['path']} "
              f"({result['bytes'] / 2**20:.1f} MiB)")
        if result.get("mtp_layers_left_out"):
            print(f"left out the {result['mtp_layers_left_out']} MTP module(s): {result['architecture']} has no MTP "
                  f"weights (DeepSeek-V3 does)")
    return 0
