"""An outside fuzzer against the REST API: schemathesis ``--checks all`` (every phase, a fixed
seed, about 30 s) against a real ``raytron serve --launcher processes`` finds nothing
(bench/api_fuzz.py: the server, the blocker that keeps fuzzed jobs queued, the one configured
exception of bench/schemathesis.toml). ``python -m bench.api_fuzz --seconds 180`` runs it longer."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers.paths import ROOT_DIR as ROOT
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")
from bench import api_fuzz  # noqa: E402

pytestmark = pytest.mark.procs  # a real server process (and the blocker job's runner)


def test_schemathesis_finds_nothing():
    result = api_fuzz.main(["--seconds", "30", "--seed", "1"])
    tail = result["output"][-6000:]
    assert "generated" in result["output"], tail  # it ran (mutation: a wrong token -> every case 401, failures)
    assert result["returncode"] == 0, tail
    assert result["server_tracebacks"] == 0, tail


def test_schemathesis_as_two_users_finds_no_auth_bypass():
    """Two users' tokens configured (alice and bob as peers): ``ignored_auth`` (a request without
    or with a wrong token passes) and ``object_level_authorization`` (one user's job shown to the
    other) find nothing (mutation: require_job_access lets every user through -> ST402 on
    GET /jobs/{job_id} and /placement)."""
    result = api_fuzz.main(["--users", "--seconds", "15", "--seed", "1"])
    tail = result["output"][-6000:]
    assert "generated" in result["output"], tail
    assert result["returncode"] == 0, tail
    assert result["server_tracebacks"] == 0, tail
