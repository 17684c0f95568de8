"""Megatron's --data-path blends and the deterministic global sampler over token corpora.

A corpus (:mod:`workers.data.corpus`) is ``builtin:tiny``, a token file or a Megatron indexed
dataset, cut into train / validation / test ranges by ``training.split``.

A blend is Megatron's ``--data-path`` list: ``["0.7", "a", "0.3", "b"]`` (weight, corpus pairs)
or ``["a", "b"]`` (weights proportional to the corpora's sizes). As Megatron's
``BlendedDataset``, sample ``g`` of a blend comes from the corpus whose share is furthest
behind its weight (``build_blending_indices``), as that corpus's next sample.

Sampling is a pure function of (seed, split, global sample index): a sample is a window of
``seq_length + 1`` tokens at a pseudo-random offset drawn from its own generator (windows
cross document boundaries, as Megatron's GPT samples do). The global batch of iteration ``i``
is samples ``[i * global_batch, (i + 1) * global_batch)``, so it is the same whatever the
data-parallel size, micro-batch split or restart; the only data state to checkpoint is the
iteration number (:meth:`GlobalSampler.state_dict`). Validation batches are a second stream
of the same kind over the validation split (:meth:`GlobalSampler.validation_batch`).
"""

from __future__ import annotations

import numpy as np

from workers.data.seeding import stable_seed
from workers.data.blend import blending_indices, parse_blend
from workers.data.corpus import SPLITS, Corpus, check_corpus, data_form_problem, load_tokens
from workers.data.packing import DocumentRules, pack_rows, pack_window

__all__ = ["DataPosition", "GlobalSampler", "check_corpus", "check_data", "data_form_problem", "eval_index",
           "load_tokens"]


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
        self.corpora = [Corpus(p, split) for p in prefixes]
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
