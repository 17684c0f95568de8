"""The sampler of a chat fine-tuning job (``training.chat_data``).

**Map-style** (the default): every record is rendered and packed when the job starts
(:class:`workers.data.chat.ChatDataset`); iteration ``i``'s global batch is packed rows
``[i * global_batch_size, (i + 1) * global_batch_size)`` (rows repeat, in the same seeded order,
once the data is used up).

**Streaming** (``training.chat_streaming``, data larger than memory): records are read as a stream
and packed ``STREAM_BUFFER`` samples at a time (best-fit-decreasing within each buffer, the
buffer's rows in a seeded order), so memory holds one buffer; at the end of the data the stream
starts again. Rows come out in one deterministic order, the same on every rank, so row ``k`` is
found by reading the stream up to it: a restarted job reads (not trains) the rows before its
iteration and goes on at the next unseen one.

Either way every rank reads the same rows and a restart goes on where the checkpoint left off.
"""

from __future__ import annotations

from workers.data.seeding import stable_seed
from workers.data.dataset import DataPosition
from workers.data.chat import ChatDataError, ChatDataset, load_tokenizer, make_row, pack, samples
from workers.data.packing import pack_rows

STREAM_BUFFER = 1024
"""Samples packed together when streaming."""


class ChatStream:
    """Packed rows of a record stream, in order (see the module docstring); ``row(k)`` for any ``k``,
    cheapest in increasing order."""

    def __init__(self, t, seq_length: int, buffer: int = STREAM_BUFFER):
        self.t, self.seq_length, self.buffer = t, seq_length, buffer
        self.tok = load_tokenizer(t.chat_tokenizer)
        self._rows, self._first, self._next = [], 0, None  # the current buffer's rows, the first's index

    def _generate(self):
        t, epoch, made = self.t, 0, 0
        while True:
            pending, chunk = [], 0
            for pair in samples(t.chat_data, self.tok, self.seq_length, fmt=t.chat_format, loss_on=t.chat_loss_on,
                                overflow=t.chat_overflow, counts={}, streaming=True):
                pending.append(pair)
                if len(pending) == self.buffer:
                    yield self._pack(pending, (epoch, chunk))
                    made, pending, chunk = made + 1, [], chunk + 1
            if pending:
                yield self._pack(pending, (epoch, chunk))
                made += 1
            if not made:
                raise ChatDataError(f"{t.chat_data}: no sample left to train on; check training.chat_overflow and "
                                    f"model.seq_length")
            epoch += 1

    def _pack(self, pairs, key) -> list:
        seed = stable_seed(self.t.seed, f"chat-stream/{key[0]}/{key[1]}")
        packed = pack([len(ids) - 1 for ids, _ in pairs], self.seq_length, seed=seed)
        return [make_row([pairs[i] for i in row], self.seq_length) for row in packed.rows]

    def row(self, k: int):
        if self._next is None or k < self._first:  # from the start of the stream
            self._next, self._rows, self._first = self._generate(), [], 0
        while k >= self._first + len(self._rows):
            self._first += len(self._rows)
            self._rows = next(self._next)
        return self._rows[k - self._first]


class ChatSampler(DataPosition):
    """:class:`workers.data.dataset.GlobalSampler`'s interface over chat data (batches are
    :class:`workers.data.packing.PackedBatch` es)."""

    def __init__(self, t, seq_length: int):
        self.data = (ChatStream(t, seq_length) if t.chat_streaming else
                     ChatDataset(t.chat_data, t.chat_tokenizer, seq_length, t.seed, fmt=t.chat_format,
                                 loss_on=t.chat_loss_on, overflow=t.chat_overflow))
        self.seq_length = seq_length
        self.seed, self.global_batch_size, self.iteration = t.seed, t.global_batch_size, 0

    def _rows(self, iteration: int, start: int, count: int) -> list:
        base = iteration * self.global_batch_size + start
        return [self.data.row(base + j) for j in range(count)]

    def batch(self, iteration: int, start: int = 0, count: int | None = None, split: str = "train"):
        if split != "train":
            raise ValueError("chat data has no validation split")
        count = self.global_batch_size - start if count is None else count
        return pack_rows(self._rows(iteration, start, count))

    def batch_stats(self, iteration: int) -> dict:
        """What iteration ``iteration``'s global batch holds: ``loss_tokens``, ``packing_efficiency``
        (real tokens / slots: a padding document has no loss token, every sample has one) and
        ``loss_token_share`` (loss tokens / real tokens)."""
        rows = self._rows(iteration, 0, self.global_batch_size)
        loss = sum(float(r[2].sum()) for r in rows)
        real = sum(b - a for r in rows for a, b in zip(r[4], r[4][1:]) if r[2][a:b].any())
        return {"loss_tokens": loss, "packing_efficiency": real / (len(rows) * self.seq_length),
                "loss_token_share": loss / max(real, 1)}
