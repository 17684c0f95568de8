"""A job's metric curves as ``GET /api/v1/jobs/{id}/metrics`` answers them: pages and downsampled plots.

Pure functions over the store's rows ``(iteration, attempt, data)``: :func:`columns` turns rows
into the answer's parallel lists, :func:`downsample` picks at most N of them for a plot.
"""

from __future__ import annotations

import math

RESERVED = frozenset({"job_id", "iterations", "attempt", "next_after"})
"""Keys of the answer that are not metric names."""


def value(x) -> float | None:
    """A metric as JSON can carry it: a finite number, else None (NaN, inf, missing, not a number)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def columns(rows: list[tuple], names: list[str]) -> dict[str, list]:
    """``{"iterations": [...], "attempt": [...], name: [...] for each name}``, one entry per row."""
    out: dict[str, list] = {"iterations": [r[0] for r in rows], "attempt": [r[1] for r in rows]}
    for name in names:
        out[name] = [value(r[2].get(name)) for r in rows]
    return out


def downsample(values: list[float | None], attempts: list, points: int) -> list[int]:
    """The indices, ascending, of at most ``points`` of ``values`` that draw the same curve.

    Min/max buckets: the first and the last point, and every point where a new attempt begins
    (a restart or a resize: the curve may jump there), are always kept; the rest of the budget
    is split into buckets of consecutive points, each contributing its lowest and its highest
    value, so that no spike disappears from a plot (LTTB would be smoother but may drop one).
    When the kept points alone exceed ``points``, the first, the last and an even choice of the
    attempt starts are kept.

    Args:
        values: the curve the buckets look at (None where the metric is missing).
        attempts: the attempt of each point (same length; None where unknown).
        points: at most this many indices (>= 2).
    """
    n = len(values)
    if n <= points:
        return list(range(n))
    keep = {0, n - 1} | {i for i in range(1, n) if attempts[i] != attempts[i - 1]}
    if len(keep) > points:
        starts = sorted(keep - {0, n - 1})
        step = len(starts) / max(1, points - 2)
        return sorted({0, n - 1} | {starts[int(k * step)] for k in range(points - 2)})
    buckets = (points - len(keep)) // 2
    inner = n - 2
    for b in range(buckets):
        lo, hi = 1 + b * inner // buckets, 1 + (b + 1) * inner // buckets
        present = [i for i in range(lo, hi) if values[i] is not None]
        if present:
            keep.add(min(present, key=values.__getitem__))
            keep.add(max(present, key=values.__getitem__))
        elif lo < hi:
            keep.add(lo)
    assert len(keep) <= points, (len(keep), points)  # kept + 2 per bucket <= points
    return sorted(keep)
