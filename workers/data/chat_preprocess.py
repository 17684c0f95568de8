"""``raytron preprocess --format chat``: chat records rendered, checked and tokenised once into two
Megatron indexed datasets, ``PREFIX_chat_tokens`` (each sample's token ids, one document per
sample) and ``PREFIX_chat_loss_mask`` (its loss mask, uint8), so a large job's ranks read
memory-mapped files instead of rendering the records each. ``training.chat_data: PREFIX`` trains on
them (:class:`workers.data.chat.ChatDataset` packs from the index's lengths alone: milliseconds)."""

from __future__ import annotations

import numpy as np

from workers.data.chat import LOSS_MASK, TOKENS, is_preprocessed, load_tokenizer, samples  # noqa: F401
from workers.data.indexed import IndexedDatasetWriter, optimal_dtype


def preprocess_chat(input_path: str, tokenizer: str, output_prefix: str, *, seq_length: int, fmt: str = "messages",
                    loss_on: str = "assistant", overflow: str = "truncate", progress=None) -> dict:
    """Write ``output_prefix``'s two datasets; returns what was written (samples, tokens, loss tokens,
    truncated and dropped counts, the two prefixes). A bad record raises the one-line
    :class:`workers.data.chat.ChatDataError` and writes nothing."""
    tok = load_tokenizer(tokenizer)
    counts: dict = {}
    n = tokens = loss = 0
    with IndexedDatasetWriter(output_prefix + TOKENS, optimal_dtype(len(tok))) as ids_out, \
            IndexedDatasetWriter(output_prefix + LOSS_MASK, np.uint8) as mask_out:
        for ids, mask in samples(input_path, tok, seq_length, fmt=fmt, loss_on=loss_on, overflow=overflow,
                                 counts=counts, streaming=True):
            ids_out.add_document(ids)
            mask_out.add_document(mask.astype(np.uint8))
            n, tokens, loss = n + 1, tokens + len(ids), loss + int(mask[1:].sum())
            if progress is not None:
                progress(n)
    return {"samples": n, "tokens": tokens, "loss_tokens": loss, "truncated": counts.get("truncated", 0),
            "dropped": counts.get("dropped", 0), "outputs": [output_prefix + TOKENS, output_prefix + LOSS_MASK],
            "chat_data": output_prefix}
