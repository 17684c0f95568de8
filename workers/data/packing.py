"""Packed documents: the batch format of document-aware training, and how a pretraining window
becomes one.

A packed sequence holds several documents back to back. What the model needs of a microbatch
of ``b`` such sequences of ``s`` tokens is a :class:`PackedBatch`:

* ``tokens``, ``labels``: ``[b, s]`` int64, ``labels`` the next token of each input token;
* ``loss_mask``: ``[b, s]`` float32, 1 where the token's prediction counts in the loss;
* ``position_ids``: ``[b, s]`` int64, the RoPE position of each token (0 at each document's first
  token with ``reset_position_ids``);
* ``cu_seqlens``: per row, the document boundaries ``(0, c_1, ..., s)`` (cumulative lengths, as
  FlashAttention's varlen and Megatron's THD format): attention never crosses one. ``(0, s)`` is
  one causal sequence. Padding is a document of its own with a zero loss mask.

A chat-SFT dataset produces these directly (the labels of its prompt tokens masked); the
pretraining sampler (:meth:`workers.data.dataset.GlobalSampler.batch`) makes them from a window of
the token stream with Megatron's switches (:class:`DocumentRules`): documents start after an EOD
token or at an indexed dataset's sequence boundaries. With ``reset_attention_mask`` no loss is
taken across a boundary (the last token of a document does not predict the next one's first),
and ``eod_mask_loss`` masks every position whose input is the EOD token, as Megatron's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DocumentRules:
    """Megatron's ``reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss`` and the EOD id."""

    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    eod_token_id: int | None = None

    @classmethod
    def of(cls, training) -> "DocumentRules":
        return cls(training.reset_position_ids, training.reset_attention_mask, training.eod_mask_loss,
                   training.eod_token_id)

    @property
    def needs_documents(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask

    @property
    def packed(self) -> bool:
        """Whether batches differ from plain windows (documents or a loss mask)."""
        return self.needs_documents or self.eod_mask_loss


@dataclass
class PackedBatch:
    """A microbatch of packed sequences (see the module docstring); tensors ``[b, s]``."""

    tokens: object
    labels: object
    loss_mask: object
    position_ids: object
    cu_seqlens: tuple


def check_cu_seqlens(cu_seqlens: tuple, seq_len: int) -> None:
    """Refuse boundaries that are not ``0 = c_0 < c_1 < ... < c_n = seq_len`` per row."""
    for r, cu in enumerate(cu_seqlens):
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or any(a >= b for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens of row {r} is {cu}; expected increasing boundaries from 0 to {seq_len}")


def position_ids(cu_seqlens: tuple, seq_len: int) -> np.ndarray:
    """``[b, s]`` positions that restart at 0 at every boundary of each row."""
    out = np.empty((len(cu_seqlens), seq_len), dtype=np.int64)
    for r, cu in enumerate(cu_seqlens):
        for a, b in zip(cu, cu[1:]):
            out[r, a:b] = np.arange(b - a)
    return out


def pack_window(window: np.ndarray, starts, rules: DocumentRules):
    """One packed row from a window of ``s + 1`` tokens of a stream.

    Args:
        window: ``[s + 1]`` token ids (inputs are the first ``s``, labels the last ``s``).
        starts: window indices ``j`` in ``1..s`` where a document starts (from an indexed dataset);
            the token after each EOD starts one too.
        rules: the switches.

    Returns:
        ``(tokens, labels, loss_mask, position_ids, cu_seqlens)`` of the row (numpy; ``cu_seqlens``
        a tuple).
    """
    s = len(window) - 1
    tokens, labels = window[:-1], window[1:]
    cuts = {int(j) for j in starts if 0 < j <= s}
    if rules.eod_token_id is not None and rules.needs_documents:
        cuts |= {int(j) + 1 for j in np.flatnonzero(tokens == rules.eod_token_id)}
    inner = tuple(sorted(j for j in cuts if j < s))
    docs = (0, *inner, s)
    mask = np.ones(s, dtype=np.float32)
    if rules.reset_attention_mask:
        mask[[j - 1 for j in sorted(cuts)]] = 0.0  # the prediction across each boundary
    if rules.eod_mask_loss:
        mask[tokens == rules.eod_token_id] = 0.0
    positions = position_ids((docs,), s)[0] if rules.reset_position_ids else np.arange(s)
    return tokens, labels, mask, positions, docs if rules.reset_attention_mask else (0, s)


def pack_rows(rows) -> PackedBatch:
    """A :class:`PackedBatch` of :func:`pack_window` rows (torch tensors)."""
    import torch

    tokens, labels, mask, positions, docs = zip(*rows)

    def stack(parts):
        return torch.from_numpy(np.stack(parts))

    return PackedBatch(stack(tokens), stack(labels), stack(mask), stack(positions), tuple(docs))
