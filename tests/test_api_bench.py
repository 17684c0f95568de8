"""bench/api_bench.py runs end to end on its smallest case (no timing is asserted)."""

from __future__ import annotations

import os
import sys

from tests.helpers.paths import ROOT_DIR as ROOT

if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest

from bench import api_bench  # noqa: E402


@pytest.mark.procs
def test_api_bench_smallest_case(capsys):
    result = api_bench.main(["--clients", "4", "--requests", "3", "--submissions", "5"])
    assert result["get_p99_ms"] >= result["get_p50_ms"] > 0 and result["submissions_per_s"] > 0
    assert "submissions/s" in capsys.readouterr().out
