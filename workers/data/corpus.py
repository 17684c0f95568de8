"""A corpus's tokens: built-in text, token files and Megatron indexed datasets, their checks and splits.

``training.data`` names one corpus or a blend of several (:mod:`workers.data.blend`). A corpus is

* ``builtin:tiny``: a small English text shipped with the package, tokenised as bytes (vocab 256);
* a ``.npy`` array or a raw ``uint16`` ``.bin`` file of token ids;
* a Megatron indexed dataset given by its prefix ``PATH`` (``PATH.bin`` + ``PATH.idx``, as
  Megatron's ``preprocess_data.py`` and ``raytron preprocess`` write them); ``PATH.bin`` names
  the same dataset when ``PATH.idx`` exists beside it.

``training.split`` ("969,30,1") cuts every corpus into train / validation / test ranges the
way Megatron's ``BlendedMegatronDatasetBuilder`` does: bookends from the normalised split, times
the number of sequences (documents) of an indexed dataset, rounded; a flat token file has no
documents, so its tokens are cut instead (:class:`Corpus`).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from workers.data.blend import parse_blend, split_bookends
from workers.data.indexed import IndexedDataset, is_indexed_dataset

BUILTIN = {"builtin:tiny": "tiny.txt"}
SPLITS = ("train", "valid", "test")
_TEXT_SUFFIXES = (".txt", ".json", ".jsonl", ".gz", ".csv", ".parquet", ".idx")


def load_tokens(data):
    """All tokens of a corpus (or, concatenated, of a blend) as an integer array.

    Small corpora come back as int64; an indexed dataset as its memory-mapped ``.bin``.
    """
    if isinstance(data, (list, tuple)):
        return _load_tokens(tuple(data))
    return _load_tokens(data)


@lru_cache(maxsize=4)
def _load_tokens(data):
    if isinstance(data, tuple):
        prefixes, _ = parse_blend(data)
        return np.concatenate([np.asarray(load_tokens(p), dtype=np.int64) for p in prefixes])
    indexed = _open_indexed(data)
    if indexed is not None:
        return indexed.tokens
    if data in BUILTIN:
        raw = resources.files("workers").joinpath("data", BUILTIN[data]).read_bytes()
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    if data.startswith("builtin:"):
        raise ValueError(f"unknown built-in corpus {data!r}; available: {sorted(BUILTIN)}")
    path = Path(data)
    if path.suffix in (".npy", ".bin") and not path.exists():
        raise ValueError(f"training.data: token file {data!r} does not exist")
    if path.suffix == ".npy":
        return np.load(path).astype(np.int64).reshape(-1)
    if path.suffix == ".bin":
        return np.fromfile(path, dtype=np.uint16).astype(np.int64)
    raise ValueError(f"training.data {data!r}: no {data}.bin + {data}.idx (a Megatron prefix), and not "
                     f"builtin:tiny or a .npy or .bin token file")


@lru_cache(maxsize=16)
def _open_indexed(data: str) -> IndexedDataset | None:
    """The indexed dataset ``data`` names (a prefix, or ``PREFIX.bin`` beside ``PREFIX.idx``), or None."""
    if data.startswith("builtin:"):
        return None
    prefix = data[: -len(".bin")] if data.endswith(".bin") else data
    return IndexedDataset(prefix) if is_indexed_dataset(prefix) else None


def check_corpus(data, vocab_size: int, seq_length: int) -> None:
    """Refuse a corpus that is not a file of integer token ids, is too short, or has ids
    outside ``[0, vocab_size)``; each message names training.data and the fix. A blend is
    checked corpus by corpus."""
    if isinstance(data, (list, tuple)):
        for prefix in parse_blend(data)[0]:
            check_corpus(prefix, vocab_size, seq_length)
        return
    path = Path(data)
    if not data.startswith("builtin:") and path.is_dir():
        raise ValueError(f"training.data {data!r} is a directory; give a token file (.npy or .bin) inside it")
    if path.suffix == ".npy" and path.is_file():
        try:
            dtype = np.load(path, mmap_mode="r").dtype
        except (ValueError, OSError) as e:
            raise ValueError(f"training.data {data!r} is not a readable .npy array ({e})") from None
        if dtype.kind not in "iu":
            raise ValueError(f"training.data {data!r} holds {dtype} values, not token ids; save integer ids, "
                             f"e.g. np.save(path, ids.astype(np.int32))")
    tokens = load_tokens(data)
    if len(tokens) < seq_length + 2:
        raise ValueError(f"training.data {data!r} has {len(tokens)} tokens, fewer than seq_length+2 = {seq_length + 2}")
    low, top = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise ValueError(f"training.data {data!r} has negative token id {low}; token ids are 0..vocab_size-1")
    if top >= vocab_size:
        raise ValueError(f"training.data {data!r} has token id {top} >= model.vocab_size {vocab_size}; raise vocab_size")


def data_form_problem(data) -> str | None:
    """What is wrong with the form of ``training.data`` (no file access), or None."""
    if isinstance(data, (list, tuple)):
        try:
            prefixes, _ = parse_blend(data)
        except ValueError as e:
            return str(e)
        return next((p for p in map(data_form_problem, prefixes) if p), None)
    if not isinstance(data, str) or not data.strip():
        return f"training.data {data!r}: expected a corpus path or a list such as ['0.7', 'a', '0.3', 'b']"
    if Path(data).suffix.lower() in _TEXT_SUFFIXES:
        return (f"training.data {data!r}: use builtin:tiny, a token file ending in .npy or .bin, or a Megatron "
                f"prefix (PATH for PATH.bin + PATH.idx); tokenise text first with `raytron preprocess`")
    return None


class Corpus:
    """One corpus's tokens and the [start, stop) token range of each split."""

    def __init__(self, data: str, split: str | None):
        self.name = data
        self.tokens = load_tokens(data)
        indexed = _open_indexed(data)
        num_elements = len(indexed) if indexed is not None else len(self.tokens)
        # Where each indexed sequence (a document) starts in the token stream; a flat file has none.
        self.doc_starts = (np.cumsum(indexed.sequence_lengths, dtype=np.int64) if indexed is not None
                           else np.zeros(0, dtype=np.int64))
        self.ranges = {}
        for name, bookend in zip(SPLITS, split_bookends(split)):
            if bookend is None:
                self.ranges[name] = (0, 0)
                continue
            # Megatron: int(round(fraction * elements)), over sequences of an indexed dataset.
            beg, end = (int(round(f * float(num_elements))) for f in bookend)
            self.ranges[name] = indexed.token_range(beg, end) if indexed is not None else (beg, end)

    def size(self, split: str) -> int:
        start, stop = self.ranges[split]
        return stop - start
