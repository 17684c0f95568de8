"""The seeds of the data samplers' random draws: a 63-bit function of the job seed and a name, the same in every layout.

:mod:`workers.data.dataset` seeds each sample's window and :mod:`workers.data.chat_sampler` the packing
of each streamed buffer with :func:`stable_seed`.
"""

from __future__ import annotations

import hashlib


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the job seed and a name (``sample/INDEX``, ``chat-stream/...``).

    Each draw has its own generator, so what it draws depends only on (seed, name), never on
    which ranks or samples came before it.
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
