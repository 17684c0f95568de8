"""api/rest/curves.py: the downsampling of ``GET /jobs/{id}/metrics?points=N``, over plain lists."""

from __future__ import annotations

import random

import pytest

from api.rest.curves import columns, downsample, value


@pytest.mark.parametrize("n,points", [(1, 2), (10, 10), (11, 10), (1000, 2), (1000, 3), (1000, 500), (20000, 500)])
def test_at_most_n_points_with_both_ends(n, points):
    rng = random.Random(n)
    values = [rng.random() for _ in range(n)]
    kept = downsample(values, [1] * n, points)
    assert len(kept) <= points and kept == sorted(set(kept))
    assert kept[0] == 0 and kept[-1] == n - 1
    if n <= points:
        assert kept == list(range(n))


def test_spikes_and_attempt_starts_survive():
    n = 10000
    values = [1.0] * n
    values[1234], values[8765] = 50.0, -50.0
    attempts = [1] * 4000 + [2] * 3000 + [3] * 3000
    kept = downsample(values, attempts, 100)
    assert {1234, 8765, 4000, 7000} <= set(kept)  # mutation: buckets keep their first point -> spikes lost


def test_too_many_attempt_starts_are_thinned_evenly_keeping_the_ends():
    attempts = list(range(1000))  # every point starts an attempt
    kept = downsample([0.0] * 1000, attempts, 10)
    assert len(kept) == 10 and kept[0] == 0 and kept[-1] == 999


def test_missing_values_and_columns():
    kept = downsample([None] * 50 + [1.0] * 50, [1] * 100, 10)
    assert len(kept) <= 10 and kept[0] == 0 and kept[-1] == 99
    rows = [(1, 1, {"loss": 2.0, "lr": float("nan")}), (2, None, {"loss": True})]
    assert columns(rows, ["loss", "lr", "x"]) == {"iterations": [1, 2], "attempt": [1, None], "loss": [2.0, None],
                                                 "lr": [None, None], "x": [None, None]}
    assert value(float("inf")) is None and value(3) == 3.0
