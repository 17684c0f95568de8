"""Chat and instruction data for fine-tuning: samples rendered with the tokenizer's own chat
template, a loss mask on the assistant's tokens, and packing into ``seq_length`` rows.

**Reading.** Records come from local JSONL (``.json``/``.jsonl``), Parquet or Arrow files, or a
directory of them, read with Hugging Face ``datasets``. Two formats:

* ``messages``: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``
  (OpenAI / ShareGPT-style), rendered with ``tokenizer.apply_chat_template``;
* ``prompt_completion``: ``{"prompt": str, "completion": str}``, plain text: the prompt's tokens,
  the completion's and the tokenizer's EOS token (a base model needs no template).

A record the format cannot take is refused before training starts, naming the file, the line
(1-based, the record's index for Parquet/Arrow) and the fix: no ``messages``, an unknown role, an
empty assistant turn, a tokenizer without a chat template, a sample longer than ``seq_length``
with ``overflow: error``.

**Loss mask** (``loss_on``): ``assistant`` (every assistant turn), ``last_assistant`` or ``all``. An
assistant turn's tokens are those its message adds to the conversation rendered up to the
generation prompt before it: ``render(messages[:i+1])`` minus ``render(messages[:i],
add_generation_prompt=True)``, the template's end-of-turn token included and trailing whitespace
after it not. A template with ``{% generation %}`` markers gives the same mask as transformers'
``return_assistant_tokens_mask`` (``tests/workers/data/test_chat.py``); a template that does not
render a conversation's prefix as a prefix of its tokens is refused (add generation markers).

**Packing.** Each sample of ``n`` tokens is a document of ``n - 1`` positions (inputs ``t[:-1]``,
labels ``t[1:]``, the mask of each label). Documents are packed best-fit-decreasing into rows of
``seq_length`` positions, the rest of a row a padding document with no loss, and the rows put in a
seeded order: the same data and seed give the same rows on every rank and every restart, so a
restart goes on at the next unseen row. A row is the tuple :func:`workers.data.packing.pack_rows`
takes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
TOKENS, LOSS_MASK = "_chat_tokens", "_chat_loss_mask"
"""The suffixes of the two indexed datasets ``raytron preprocess --format chat`` writes
(:mod:`workers.data.chat_preprocess`)."""
SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


class ChatDataError(ValueError):
    """A record or setting the chat data path cannot take (one line: file, line, fix)."""


def data_files(path: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder and the files of a data file or directory."""
    p = Path(path)
    files = sorted(str(f) for f in p.iterdir() if f.suffix in SUFFIXES) if p.is_dir() else [str(p)]
    if not p.exists() or not files:
        raise ChatDataError(f"{path}: no such file, or a directory without .jsonl/.json/.parquet/.arrow files")
    kinds = {SUFFIXES.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ChatDataError(f"{path}: chat data are .jsonl/.json, .parquet or .arrow files, one kind per directory")
    return kinds.pop(), files


def read_records(path: str, *, streaming: bool = False):
    """Yield ``(file, line, record)`` of every record, in order (``line`` 1-based)."""
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()  # a rank's log, and the CLI's one-line errors, stay clean
    datasets.logging.set_verbosity_error()
    builder, files = data_files(path)
    for f in files:
        ds = load_dataset(builder, data_files=f, split="train", streaming=streaming)
        for i, record in enumerate(ds):
            yield f, i + 1, record


def load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ChatDataError(f"tokenizer {directory}: cannot be loaded ({str(e).splitlines()[0]}); point it at a "
                            f"directory with tokenizer files (the from_hf model's)") from None


def _ids(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def _check_messages(record, where: str) -> list[dict]:
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: no messages; each record needs \"messages\": [{{\"role\", \"content\"}}, ...] "
                            f"(or use format prompt_completion)")
    for m in messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ChatDataError(f"{where}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ChatDataError(f"{where}: a {role} message without string content")
        if role == "assistant" and not m["content"].strip():
            raise ChatDataError(f"{where}: an empty assistant turn; remove the record or give the turn its text")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: no assistant turn: nothing to learn from it")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def assistant_mask(tok, messages: list[dict], loss_on: str, where: str) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and its loss mask (see the module docstring)."""
    ids = _ids(tok, messages)
    if loss_on == "all":
        return ids, [1] * len(ids)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if loss_on == "last_assistant":
        turns = turns[-1:]
    mask = [0] * len(ids)
    for i in turns:
        start = len(_ids(tok, messages[:i], add_generation_prompt=True)) if i else 0
        upto = _ids(tok, messages[: i + 1])
        if ids[: len(upto)] != upto:
            raise ChatDataError(f"{where}: the tokenizer's chat template does not render a conversation's start as "
                                f"the start of the whole; give it {{% generation %}} markers")
        end = len(upto)
        while end > start and not tok.decode(ids[end - 1:end]).strip():  # whitespace after the end of turn
            end -= 1
        mask[start:end] = [1] * (end - start)
    return ids, mask


def render(tok, record, fmt: str, loss_on: str, where: str) -> tuple[list[int], list[int]]:
    """One record's token ids and loss mask."""
    if fmt == "prompt_completion":
        prompt, completion = (record.get(k) if isinstance(record, dict) else None for k in ("prompt", "completion"))
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion.strip():
            raise ChatDataError(f"{where}: format prompt_completion needs string \"prompt\" and a non-empty "
                                f"\"completion\"")
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(completion, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        return p + c, ([1] * len(p) if loss_on == "all" else [0] * len(p)) + [1] * len(c)
    if not getattr(tok, "chat_template", None):
        raise ChatDataError(f"the tokenizer has no chat template, which format messages needs; use a chat model's "
                            f"tokenizer or format prompt_completion")
    return assistant_mask(tok, _check_messages(record, where), loss_on, where)


@dataclass
class Packed:
    """Documents packed into rows: per row, the sample indices in it, in order."""

    rows: list[list[int]]
    lengths: np.ndarray
    """Each sample's positions (tokens - 1)."""
    stats: dict = field(default_factory=dict)


def pack(lengths, seq_length: int, seed: int) -> Packed:
    """Best-fit-decreasing packing of documents of ``lengths`` positions into rows of
    ``seq_length``, rows in a seeded order (ties broken by sample index: deterministic)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row), sorted
    for i in order:
        n = int(lengths[i])
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            free, r = room.pop(k)
        else:
            free, r = seq_length, len(rows)
            rows.append([])
        rows[r].append(i)
        if free - n > 0:
            bisect.insort(room, (free - n, r))
    perm = np.random.default_rng(seed).permutation(len(rows))
    rows = [sorted(rows[j]) for j in perm]
    used = int(lengths.sum())
    return Packed(rows, lengths, {"rows": len(rows), "efficiency": used / max(1, len(rows) * seq_length)})


def samples(path: str, tok, seq_length: int, *, fmt: str, loss_on: str, overflow: str, counts: dict,
            streaming: bool = False):
    """Yield ``(ids, mask)`` numpy arrays of every usable record, in order: rendered, checked, cut to
    ``seq_length + 1`` tokens (``truncate``) or left out (``drop``, counted in ``counts``); a sample
    with no loss token left is dropped too."""
    for f, line, record in read_records(path, streaming=streaming):
        where = f"{f} line {line}"
        ids, mask = render(tok, record, fmt, loss_on, where)
        if len(ids) > seq_length + 1:
            if overflow == "error":
                raise ChatDataError(f"{where}: {len(ids)} tokens, more than seq_length {seq_length} + 1; raise "
                                    f"model.seq_length or set training.chat_overflow: truncate or drop")
            if overflow == "drop":
                counts["dropped"] = counts.get("dropped", 0) + 1
                continue
            ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
            counts["truncated"] = counts.get("truncated", 0) + 1
        if len(ids) < 2 or not any(mask[1:]):
            counts["dropped"] = counts.get("dropped", 0) + 1  # nothing to predict
            continue
        yield np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.float32)


def make_row(docs, seq_length: int, pad: int = 0):
    """One packed row of ``(ids, mask)`` documents: ``(tokens, labels, loss_mask, position_ids,
    cu_seqlens)``, the rest of the row a padding document with no loss."""
    s = seq_length
    tokens, labels = np.full(s, pad, np.int64), np.full(s, pad, np.int64)
    mask, positions = np.zeros(s, np.float32), np.zeros(s, np.int64)
    cu, at = [0], 0
    for ids, m in docs:
        n = len(ids) - 1
        tokens[at:at + n], labels[at:at + n], mask[at:at + n] = ids[:-1], ids[1:], m[1:]
        positions[at:at + n] = np.arange(n)
        at += n
        cu.append(at)
    if at < s:
        positions[at:] = np.arange(s - at)
        cu.append(s)
    return tokens, labels, mask, positions, tuple(cu)


class ChatDataset:
    """Every record rendered, checked and packed (map-style): row ``k`` as a packed row.

    Args:
        path: a file or directory of records.
        tokenizer: a tokenizer directory.
        seq_length: positions per row.
        seed: the row order's seed.
        fmt: ``messages`` | ``prompt_completion``.
        loss_on: ``assistant`` | ``last_assistant`` | ``all``.
        overflow: a sample of more than ``seq_length + 1`` tokens is ``truncate`` d, ``drop`` ped or an ``error``.
    """

    def __init__(self, path: str, tokenizer: str | None, seq_length: int, seed: int, *, fmt: str = "messages",
                 loss_on: str = "assistant", overflow: str = "truncate", pad_token_id: int = 0):
        self.seq_length, self.pad = seq_length, pad_token_id
        counts: dict = {}
        if is_preprocessed(path):  # raytron preprocess --format chat: memory-mapped, read per row
            self.ids, self.masks = _preprocessed(path, seq_length)
        else:
            pairs = list(samples(path, load_tokenizer(tokenizer), seq_length, fmt=fmt, loss_on=loss_on,
                                 overflow=overflow, counts=counts))
            self.ids, self.masks = [p[0] for p in pairs], [p[1] for p in pairs]
        if not len(self.ids):
            raise ChatDataError(f"{path}: no sample left to train on ({counts.get('dropped', 0)} dropped); check "
                                f"training.chat_overflow and model.seq_length")
        lengths = (self.ids.data.sequence_lengths if isinstance(self.ids, _Column) else
                   np.array([len(x) for x in self.ids]))
        self.packed = pack(lengths - 1, seq_length, seed)
        loss = sum(float(self.masks[i][1:].sum()) for i in range(len(self.masks)))
        self.stats = {"samples": len(self.ids), "truncated": counts.get("truncated", 0),
                      "dropped": counts.get("dropped", 0), "loss_token_share": loss / float(self.packed.lengths.sum()),
                      **self.packed.stats}

    def __len__(self) -> int:
        return len(self.packed.rows)

    def row(self, k: int):
        """Row ``k`` (taken modulo the rows: epochs repeat the order) as ``(tokens, labels,
        loss_mask, position_ids, cu_seqlens)``."""
        rows = self.packed.rows[k % len(self.packed.rows)]
        return make_row([(self.ids[i], self.masks[i]) for i in rows], self.seq_length, self.pad)


class _Column:
    """One indexed dataset's documents as arrays of ``dtype``, read on access (memory-mapped)."""

    def __init__(self, prefix: str, dtype):
        from workers.data.indexed import IndexedDataset

        self.data, self.dtype = IndexedDataset(prefix), dtype

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.data[i], dtype=self.dtype)


def _preprocessed(prefix: str, seq_length: int) -> tuple[_Column, _Column]:
    ids, masks = _Column(prefix + TOKENS, np.int64), _Column(prefix + LOSS_MASK, np.float32)
    longest = int(np.max(ids.data.sequence_lengths)) if len(ids) else 0
    if longest > seq_length + 1:
        raise ChatDataError(f"{prefix}: preprocessed with samples of up to {longest} tokens, more than model.seq_length "
                            f"{seq_length} + 1; preprocess again with --seq-length {seq_length}")
    return ids, masks


def is_preprocessed(prefix: str) -> bool:
    """Whether ``prefix`` names the output of ``raytron preprocess --format chat``."""
    from workers.data.indexed import is_indexed_dataset

    return is_indexed_dataset(prefix + TOKENS) and is_indexed_dataset(prefix + LOSS_MASK)
