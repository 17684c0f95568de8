"""The session's own check that nothing a test started outlives the run (tests/conftest.py),
run on a small session of its own: a test that leaves a process behind fails the run, naming
the process; one that cleans up passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F401,F403\n")
    # procs: the inner test starts a process, which a test without a tier marker may not
    (tmp_path / "test_inner.py").write_text("import subprocess\n\nimport pytest\n\npytestmark = pytest.mark.procs\n\n\n"
                                            "def test_inner():\n" + body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAYTRON_LEFTOVER_WAIT_S": "1"})


@pytest.mark.procs
def test_a_process_that_outlives_the_tests_fails_the_run(tmp_path):
    p = _session(tmp_path, "    subprocess.Popen(['sleep', '97'], start_new_session=True)\n")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 passed" in p.stdout and "outlived them" in p.stdout and "sleep 97" in p.stdout, p.stdout
    left = subprocess.run(["pgrep", "-f", "^sleep 97$"], capture_output=True, text=True).stdout.split()
    assert left == []  # and it was stopped


@pytest.mark.procs
def test_a_session_that_cleans_up_passes(tmp_path):
    p = _session(tmp_path, "    subprocess.run(['true'], check=True)\n")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "outlived" not in p.stdout
