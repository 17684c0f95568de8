"""Token data, Megatron's --data-path blends and --split, and the deterministic global sampler.

``training.data`` is one corpus or a blend of several. A corpus is

* ``builtin:tiny``: a small English text shipped with the package, tokenised as bytes (vocab 256);
* a ``.npy`` array or a raw ``uint16`` ``.bin`` file of token ids;
* a Megatron indexed dataset given by its prefix ``PATH`` (``PATH.bin`` + ``PATH.idx``, as
  Megatron's ``preprocess_data.py`` and ``raytron preprocess`` write them); ``PATH.bin`` names
  the same dataset when ``PATH.idx`` exists beside it.

A blend is Megatron's ``--data-path`` list: ``["0.7", "a", "0.3", "b"]`` (weight, corpus pairs)
or ``["a", "b"]`` (weights proportional to the corpora's sizes). As Megatron's
``BlendedDataset``, sample ``g`` of a blend comes from the corpus whose share is furthest
behind its weight (``build_blending_indices``), as that corpus's next sample.

``training.split`` ("969,30,1") cuts every corpus into train / validation / test ranges the
way Megatron's ``BlendedMegatronDatasetBuilder`` does: bookends from the normalised split, times
the number of sequences (documents) of an indexed dataset, rounded; a flat token file has no
documents, so its tokens are cut instead.

Sampling is a pure function of (seed, split, global sample index): a sample is a window of
``seq_length + 1`` tokens at a pseudo-random offset drawn from its own generator (windows
cross document boundaries, as Megatron's GPT samples do). The global batch of iteration ``i``
is samples ``[i * global_batch, (i + 1) * global_batch)``, so it is the same whatever the
data-parallel size, micro-batch split or restart; the only data state to checkpoint is the
iteration number (:meth:`GlobalSampler.state_dict`). Validation batches are a second stream
of the same kind over the validation split (:meth:`GlobalSampler.validation_batch`).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from workers.config import stable_seed
from workers.data.blend import blending_indices, parse_blend, split_bookends
from workers.data.indexed import IndexedDataset, is_indexed_dataset
from workers.data.packing import DocumentRules, pack_rows, pack_window

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


class _Corpus:
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


class DataPosition:
    """A sampler's position in a checkpoint: the iteration (global batches are a pure function of it
    and the seed) and the seed, which a resumed job must share."""

    iteration: int
    seed: int

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint data seed {state['seed']} differs from training.seed {self.seed}")
        self.iteration = state["iteration"]


class GlobalSampler(DataPosition):
    """Deterministic samples by global index; each is ``seq_length + 1`` tokens (input + shifted target).

    Args:
        data: ``training.data``: a corpus or a blend list.
        seq_length: tokens per sample (one more is read for the shifted labels).
        seed: ``training.seed``.
        global_batch_size: samples per iteration.
        split: ``training.split``; None uses every token for training (no validation data).
        rules: packed documents (:class:`workers.data.packing.DocumentRules`): :meth:`batch` returns
            a :class:`workers.data.packing.PackedBatch`; None: ``(tokens, labels)``.
    """

    def __init__(self, data, seq_length: int, seed: int, global_batch_size: int, *, split: str | None = None,
                 rules: DocumentRules | None = None):
        if isinstance(data, (list, tuple)):
            prefixes, weights = parse_blend(data)
            self._blend = True
        else:
            prefixes, weights, self._blend = [data], [1.0], False
        self.corpora = [_Corpus(p, split) for p in prefixes]
        self.seq_length = seq_length
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.split = split
        self.rules = rules
        self.iteration = 0
        self._weights = {}
        for name in SPLITS:
            w = weights if weights is not None else [float(c.size(name)) for c in self.corpora]
            total = float(np.sum(w))
            self._weights[name] = (np.array(w, dtype=np.float64) / total).tolist() if total > 0 else None
        self._blend_cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._check("train")

    def _check(self, split: str) -> None:
        """Every corpus with a share of ``split`` must hold one sample; the message says which does not."""
        weights = self._weights[split]
        if weights is None or not any(c.size(split) for c in self.corpora):
            raise ValueError(f"training.split {self.split!r} leaves no {split} data in training.data; "
                             f"give the {split} split a share, e.g. '969,30,1'")
        for corpus, w in zip(self.corpora, weights):
            if w > 0 and corpus.size(split) < self.seq_length + 1:
                raise ValueError(f"the {split} split of training.data {corpus.name!r} has {corpus.size(split)} "
                                 f"tokens, fewer than seq_length+1 = {self.seq_length + 1}; use more data, a larger "
                                 f"{split} share in training.split ({self.split!r}) or a shorter seq_length")

    def _locate(self, index: int, split: str) -> tuple[int, int]:
        """(corpus, sample index within it) of global sample ``index`` of ``split``."""
        if not self._blend:
            return 0, index
        cached = self._blend_cache.get(split)
        if cached is None or len(cached[0]) <= index:
            size = max(2 * index + 1, 1024, 0 if cached is None else 2 * len(cached[0]))
            cached = self._blend_cache[split] = blending_indices(self._weights[split], size)
        return int(cached[0][index]), int(cached[1][index])

    def sample(self, index: int, split: str = "train"):
        """Global sample ``index`` of ``split`` as a ``[seq_length + 1]`` int64 tensor."""
        import torch  # not at module level: the driver validates corpora without torch

        return torch.from_numpy(self._window(index, split)[0])

    def _window(self, index: int, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``index``'s tokens and the window indices where an indexed corpus's documents start."""
        import torch

        d, k = self._locate(index, split)
        corpus = self.corpora[d]
        start, stop = corpus.ranges[split]
        # Train samples of a single corpus keep their original key, so existing runs see the same data.
        key = ("" if split == "train" else f"{split}/") + (f"blend{d}/" if self._blend else "") + f"sample/{k}"
        g = torch.Generator().manual_seed(stable_seed(self.seed, key))
        offset = start + int(torch.randint(0, stop - start - self.seq_length, (1,), generator=g))
        window = np.asarray(corpus.tokens[offset : offset + self.seq_length + 1], dtype=np.int64)
        starts = corpus.doc_starts
        inside = starts[np.searchsorted(starts, offset, side="right"):np.searchsorted(starts, offset + self.seq_length,
                                                                                     side="right")]
        return window, inside - offset

    def batch(self, iteration: int, start: int = 0, count: int | None = None, split: str = "train"):
        """Samples ``[start, start+count)`` of iteration's global batch as (tokens, labels), each
        [count, seq], or with ``rules`` as a :class:`~workers.data.packing.PackedBatch`."""
        import torch

        if split != "train":
            self._check(split)
        count = self.global_batch_size - start if count is None else count
        base = iteration * self.global_batch_size + start
        if self.rules is not None:
            return pack_rows([pack_window(*self._window(base + j, split), self.rules) for j in range(count)])
        rows = torch.stack([self.sample(base + j, split) for j in range(count)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def validation_batch(self, eval_index: int, eval_iter: int, eval_iters: int, start: int = 0,
                         count: int | None = None):
        """Batch ``eval_iter`` (of ``eval_iters``) of evaluation number ``eval_index`` (0-based).

        As Megatron's validation iterator, evaluations continue one stream: evaluation ``e``
        reads validation global batches ``[e * eval_iters, (e + 1) * eval_iters)``, each of
        ``global_batch_size`` samples and cut by ``start``/``count`` like :meth:`batch`.
        """
        if not 0 <= eval_iter < eval_iters:
            raise ValueError(f"eval_iter {eval_iter} is outside [0, eval_iters={eval_iters})")
        return self.batch(eval_index * eval_iters + eval_iter, start, count, split="valid")

def check_data(data, vocab_size: int, seq_length: int, split: str | None = None,
               need_validation: bool = False) -> None:
    """Refuse data the sampler cannot use: per corpus and split, too few tokens, or ids >= vocab_size.

    Stricter than :func:`check_corpus` for blends and splits (each corpus is checked on its own).
    """
    sampler = GlobalSampler(data, seq_length, 0, 1, split=split)
    if need_validation:
        sampler._check("valid")
    for corpus in sampler.corpora:
        top = int(corpus.tokens.max()) if len(corpus.tokens) else -1
        if top >= vocab_size:
            raise ValueError(f"training.data {corpus.name!r} has token id {top} >= model.vocab_size {vocab_size}; "
                             f"raise vocab_size")


def eval_index(train_iteration: int, eval_interval: int | None) -> int | None:
    """The 0-based evaluation number due after ``train_iteration`` completed iterations, or None.

    Megatron evaluates when ``iteration % eval_interval == 0``; evaluation ``e`` is the one
    after iteration ``(e + 1) * eval_interval``. A restart recomputes it from the iteration.
    Megatron also evaluates once after the last iteration: that is evaluation
    ``train_iters // eval_interval``, continuing the same validation stream.
    """
    if not eval_interval or train_iteration <= 0 or train_iteration % eval_interval:
        return None
    return train_iteration // eval_interval - 1
