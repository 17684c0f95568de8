"""Megatron's ``--data-path`` blends and ``--split``: pure parsing and index math.

:func:`parse_blend` is ``get_blend_from_list``, :func:`parse_split` and :func:`split_bookends`
are ``parse_and_normalize_split`` and ``convert_split_vector_to_split_matrix``, and
:func:`blending_indices` is ``build_blending_indices``; :mod:`workers.data.dataset` applies them to
token data.
"""

from __future__ import annotations

import functools
import re

import numpy as np


def parse_blend(blend) -> tuple[list[str], list[float] | None]:
    """Megatron's ``get_blend_from_list``: (prefixes, weights or None for size-proportional).

    Raises:
        ValueError: an empty list, weights and prefixes that do not alternate, or bad weights.
    """
    items = [str(x).strip() for x in blend]
    if not items:
        raise ValueError("training.data: an empty blend; give ['0.7', 'a', '0.3', 'b'] or ['a', 'b']")
    weights = [_as_float(x) for x in items[0::2]] if len(items) % 2 == 0 else None
    if weights is not None and all(w is not None for w in weights):
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"training.data: blend weights {weights} must be >= 0 with a positive sum")
        return items[1::2], weights
    if any(_as_float(x) is not None for x in items):
        raise ValueError(f"training.data {items}: a blend is weight, prefix pairs (['0.7', 'a', '0.3', 'b']) "
                         f"or prefixes only (['a', 'b']), not a mix")
    return items, None


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_split(split: str) -> list[float]:
    """Megatron's ``parse_and_normalize_split``: "969,30,1" -> [0.969, 0.03, 0.001].

    Raises:
        ValueError: not 1 to 3 non-negative numbers with a positive sum.
    """
    if not re.fullmatch(r"[\s.0-9,/]*", split):
        raise ValueError(f"training.split {split!r}: expected up to three numbers such as '969,30,1'")
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(parts) <= 3 or sum(parts) <= 0:
        raise ValueError(f"training.split {split!r}: expected one to three shares for train, validation, test "
                         f"with a positive sum, such as '969,30,1'")
    parts += [0.0] * (3 - len(parts))
    return (np.array(parts, dtype=np.float64) / np.sum(parts)).tolist()


def split_bookends(split: str | None) -> list[tuple[float, float] | None]:
    """Megatron's ``convert_split_vector_to_split_matrix`` (one vector): per split (begin, end) or None."""
    if split is None:
        return [(0.0, 1.0), None, None]
    expansion = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *parse_split(split)])
    return [(lo, hi) if hi > lo else None for lo, hi in zip(expansion[:-1], expansion[1:])]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's ``build_blending_indices``: per sample, its corpus and its index in that corpus."""
    dataset_index = np.zeros(size, dtype=np.int64)
    sample_index = np.zeros(size, dtype=np.int64)
    current = [0] * len(weights)
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_error = 0, weights[0] * x - current[0]
        for d in range(1, len(weights)):
            error = weights[d] * x - current[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[i], sample_index[i] = best, current[best]
        current[best] += 1
    return dataset_index, sample_index
