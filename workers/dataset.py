"""Token data and the deterministic global sampler.

``builtin:tiny`` is a small English text shipped with the package, tokenised as bytes
(vocab 256). A path to a ``.npy`` array or a raw ``uint16`` ``.bin`` file of token ids
is the user's own corpus.

Sampling is a pure function of (seed, global sample index): sample ``g`` starts at a
pseudo-random offset drawn from its own generator. The global batch of iteration ``i`` is
samples ``[i * global_batch, (i + 1) * global_batch)``, so it is the same whatever the
data-parallel size, micro-batch split or restart; the only data state to checkpoint is
the iteration number (:meth:`GlobalSampler.state_dict`).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from workers.config import stable_seed

BUILTIN = {"builtin:tiny": "tiny.txt"}


@lru_cache(maxsize=4)
def load_tokens(data: str) -> np.ndarray:
    """All tokens of a corpus as an int64 array."""
    if data in BUILTIN:
        raw = resources.files("workers").joinpath("data", BUILTIN[data]).read_bytes()
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    if data.startswith("builtin:"):
        raise ValueError(f"unknown built-in corpus {data!r}; available: {sorted(BUILTIN)}")
    path = Path(data)
    if not path.exists():
        raise ValueError(f"training.data: token file {data!r} does not exist")
    if path.suffix == ".npy":
        return np.load(path).astype(np.int64).reshape(-1)
    if path.suffix == ".bin":
        return np.fromfile(path, dtype=np.uint16).astype(np.int64)
    raise ValueError(f"training.data {data!r}: expected builtin:tiny, a .npy or a raw uint16 .bin file")


def check_corpus(data: str, vocab_size: int, seq_length: int) -> None:
    """Refuse a corpus that is not a file of integer token ids, is too short, or has ids
    outside ``[0, vocab_size)``; each message names training.data and the fix."""
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


class GlobalSampler:
    """Deterministic samples by global index; each is ``seq_length + 1`` tokens (input + shifted target)."""

    def __init__(self, data: str, seq_length: int, seed: int, global_batch_size: int):
        import torch  # not at module level: the driver validates corpora without torch

        self.tokens = torch.from_numpy(load_tokens(data))
        self.seq_length = seq_length
        self.seed = seed
        self.global_batch_size = global_batch_size
        self.iteration = 0
        self._span = len(self.tokens) - seq_length - 1

    def sample(self, index: int):
        import torch

        g = torch.Generator().manual_seed(stable_seed(self.seed, f"sample/{index}"))
        start = int(torch.randint(0, self._span + 1, (1,), generator=g))
        return self.tokens[start : start + self.seq_length + 1]

    def batch(self, iteration: int, start: int = 0, count: int | None = None):
        """Samples ``[start, start+count)`` of iteration's global batch as (tokens, labels), each [count, seq]."""
        import torch

        count = self.global_batch_size - start if count is None else count
        base = iteration * self.global_batch_size + start
        rows = torch.stack([self.sample(base + j) for j in range(count)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint data seed {state['seed']} differs from training.seed {self.seed}")
        self.iteration = state["iteration"]
