"""The full (unsharded) initial value of a parameter, for tests that compare a rank's shard with it."""

from __future__ import annotations

from workers.parallel.initializer import NormalInit


def init_full(seed: int, name: str, shape: tuple[int, ...], std: float):
    """The full (unsharded) initial value of a parameter: N(0, std^2), a pure function of
    (seed, name, shape). Ranks make only their shard of it with
    :class:`workers.parallel.initializer.NormalInit`, which gives the same numbers."""
    return NormalInit(seed, name, shape, std).materialize()
