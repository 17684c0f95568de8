"""The chat fine-tuning fields of the training section (``chat_*``, :mod:`workers.data.chat`): every
record is rendered and checked when the spec is read, so bad data is refused before anything
starts, naming the file, the line and the fix."""

from __future__ import annotations

import functools
import importlib.util
import os


def chat_problems(t, m) -> list[str]:
    """What stops ``training.chat_data`` from being trained on, each one line."""
    if not t.chat_data:
        return []
    from workers.data.chat import is_preprocessed

    if is_preprocessed(t.chat_data):
        return _preprocessed_problems(t, m)
    tokenizer = t.chat_tokenizer or m.from_hf
    if not tokenizer:
        return ["training.chat_data needs a tokenizer: set training.chat_tokenizer (a directory with tokenizer "
                "files) or model.from_hf"]
    missing = [m for m in ("datasets", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return [f"training.chat_data needs the {' and '.join(missing)} package(s), not installed: pip install "
                f"'raytron[chat]'"]
    out = []
    if t.eval_interval:
        out.append(f"training.eval_interval {t.eval_interval}: chat data has no validation split yet; set "
                   f"training.eval_interval: null")
    if t.reset_position_ids or t.reset_attention_mask or t.eod_mask_loss:
        out.append("training.chat_data packs its samples as documents itself; drop training.reset_position_ids, "
                   "reset_attention_mask and eod_mask_loss")
    try:
        stats = chat_stats(t.chat_data, _mtime(t.chat_data), tokenizer, m.seq_length, t.seed, t.chat_format,
                           t.chat_loss_on, t.chat_overflow, STREAM_CHECK if t.chat_streaming else None)
    except (ValueError, OSError) as e:
        return out + [f"training.chat_data: {e}"]
    if stats["vocab"] > m.vocab_size:
        out.append(f"training.chat_tokenizer {tokenizer} has {stats['vocab']} tokens, more than model.vocab_size "
                   f"{m.vocab_size}; raise model.vocab_size (or use the model's own tokenizer)")
    return out


def _mtime(path: str) -> float:
    """The newest modification time under ``path`` (the cache key of its check)."""
    if os.path.isdir(path):
        return max([os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)] or [0.0])
    return os.path.getmtime(path) if os.path.exists(path) else 0.0


STREAM_CHECK = 1000
"""Records of streamed chat data checked when the spec is read (the rest: when the ranks read them)."""


@functools.lru_cache(maxsize=8)
def chat_stats(path: str, mtime: float, tokenizer: str, seq_length: int, seed: int, fmt: str, loss_on: str,
               overflow: str, first: int | None = None) -> dict:
    """Render, check and pack the data (or its ``first`` records) once per (data, settings); its
    statistics and the tokenizer's vocabulary size."""
    import itertools

    from workers.data.chat import ChatDataset, load_tokenizer, samples

    tok = load_tokenizer(tokenizer)
    if first is not None:
        records = list(itertools.islice(samples(path, tok, seq_length, fmt=fmt, loss_on=loss_on, overflow=overflow,
                                                counts={}, streaming=True), first))
        return {"samples": len(records), "vocab": len(tok)}
    data = ChatDataset(path, tokenizer, seq_length, seed, fmt=fmt, loss_on=loss_on, overflow=overflow)
    return {**data.stats, "vocab": len(tok)}


def _preprocessed_problems(t, m) -> list[str]:
    """``training.chat_data`` naming ``raytron preprocess --format chat`` output."""
    import numpy as np

    from workers.data.chat import ChatDataset
    from workers.data.chat import TOKENS
    from workers.data.indexed import IndexedDataset

    out = []
    if t.chat_streaming:
        out.append(f"training.chat_streaming: {t.chat_data} is preprocessed (memory-mapped already); drop "
                   f"chat_streaming")
    if t.eval_interval:
        out.append(f"training.eval_interval {t.eval_interval}: chat data has no validation split yet; set "
                   f"training.eval_interval: null")
    try:
        ChatDataset(t.chat_data, None, m.seq_length, t.seed)
        tokens = IndexedDataset(t.chat_data + TOKENS).tokens
        top = int(np.max(tokens)) if len(tokens) else 0
    except (ValueError, OSError) as e:
        return out + [f"training.chat_data: {e}"]
    if top >= m.vocab_size:
        out.append(f"training.chat_data {t.chat_data} holds token id {top}, not below model.vocab_size {m.vocab_size}; "
                   f"raise model.vocab_size (or preprocess with the model's own tokenizer)")
    return out
