"""``raytron preprocess``: the argument parser and the command (the work is workers.data.preprocess).

Wired into ``api/cli/main.py`` with ``preprocess_cmd.add_parser(sub)``; ``run(args)`` returns the
exit status: 0, or 2 with one line on stderr for bad input.
"""

from __future__ import annotations

import json
import sys

EXAMPLE = """\
example:
  raytron preprocess corpus.jsonl --tokenizer ./llama-tokenizer --output-prefix data/corpus --append-eod
  # writes data/corpus_text_document.bin/.idx; train on it with  training.data: data/corpus_text_document
"""


def add_parser(subparsers):
    """Add the ``preprocess`` sub-command to ``subparsers`` (from ``add_subparsers``)."""
    import argparse

    p = subparsers.add_parser(
        "preprocess",
        help="tokenise a JSONL or text file into a Megatron indexed dataset (.bin/.idx)",
        description="Tokenise a JSONL file (one JSON object per line) or a text file (one document per line) "
        "with a local Hugging Face tokenizer into Megatron's indexed dataset, as Megatron-LM's "
        "tools/preprocess_data.py does: PREFIX_KEY_document.bin and .idx for each JSON key.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", help="input .jsonl/.json (JSON lines) or text file (one document per line)")
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", required=True,
                   help="a Hugging Face tokenizer directory or tokenizer.json (local; nothing is downloaded)")
    p.add_argument("--output-prefix", required=True, help="output path without suffix; _KEY_document is appended")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON keys to tokenise (default: text)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's EOS token")
    p.add_argument("--eod-token", default=None, help="the end-of-document token (default: the tokenizer's eos_token)")
    p.add_argument("--tokenizer-hf-no-include-special-tokens", dest="include_special_tokens",
                   action="store_false", help="do not add the tokenizer's special tokens (e.g. BOS) to each text")
    p.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto",
                   help="auto (default): .json/.jsonl are JSON lines, anything else is text")
    p.add_argument("--format", choices=("text", "chat"), default="text",
                   help="text: tokenise --json-keys (pretraining); chat: render chat records with the tokenizer's "
                   "chat template into PREFIX_chat_tokens and PREFIX_chat_loss_mask (training.chat_data: PREFIX)")
    p.add_argument("--chat-format", choices=("messages", "prompt_completion"), default="messages",
                   help="with --format chat: the records' form (training.chat_format)")
    p.add_argument("--loss-on", choices=("assistant", "last_assistant", "all"), default="assistant",
                   help="with --format chat: the tokens that carry loss (training.chat_loss_on)")
    p.add_argument("--overflow", choices=("truncate", "drop", "error"), default="truncate",
                   help="with --format chat: a sample longer than --seq-length + 1 tokens (training.chat_overflow)")
    p.add_argument("--seq-length", type=int, default=4096, help="with --format chat: the model's seq_length")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Run ``raytron preprocess``; 2 and one stderr line on bad input."""
    from tqdm import tqdm

    from workers.data.preprocess import HFTokenizer, preprocess

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr, disable=None)
        bar.update(done - bar.n)

    if getattr(args, "format", "text") == "chat":
        return _run_chat(args)
    try:
        tokenizer = HFTokenizer(args.tokenizer, eod_token=args.eod_token,
                                include_special_tokens=args.include_special_tokens)
        result = preprocess(args.input, tokenizer, args.output_prefix, json_keys=args.json_keys,
                            append_eod=args.append_eod, input_format=args.input_format, progress=progress)
    except ValueError as e:
        print(f"raytron preprocess: error: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"outputs": result.outputs, "documents": result.documents, "tokens": result.tokens,
                          "dtype": result.dtype, "vocab_size": result.vocab_size}))
    else:
        for key, prefix in result.outputs.items():
            print(f"{key}: {result.documents} documents, {result.tokens[key]} tokens ({result.dtype}) -> "
                  f"{prefix}.bin/.idx  (training.data: {prefix})")
    return 0


def _run_chat(args) -> int:
    """``--format chat``: :func:`workers.data.chat_preprocess.preprocess_chat`; 2 and one line on bad data."""
    from tqdm import tqdm

    from workers.data.chat_preprocess import preprocess_chat

    bar = tqdm(unit=" samples", desc="preprocess", file=sys.stderr, disable=None)
    try:
        out = preprocess_chat(args.input, args.tokenizer, args.output_prefix, seq_length=args.seq_length,
                              fmt=args.chat_format, loss_on=args.loss_on, overflow=args.overflow,
                              progress=lambda n: bar.update(n - bar.n))
    except ValueError as e:
        bar.close()
        print(f"raytron preprocess: error: {e}", file=sys.stderr)
        return 2
    bar.close()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"chat: {out['samples']} samples, {out['tokens']} tokens ({out['loss_tokens']} with loss; "
              f"{out['truncated']} truncated, {out['dropped']} dropped) -> {out['outputs'][0]}.bin/.idx and "
              f"{out['outputs'][1]}.bin/.idx  (training.chat_data: {out['chat_data']})")
    return 0
