"""The raytron command with Megatron-Core checkpoints, as a user runs it: a ``megatron:`` load that is
missing or no torch_dist checkpoint, and an export of a missing checkpoint, are refused before anything
starts with exit status 2 and one line."""

from __future__ import annotations

import pytest

from tests.helpers.cli import refused, run_refused, spec_file

pytestmark = pytest.mark.procs  # runs the raytron command in a subprocess


def test_run_refuses_a_megatron_load_that_is_no_checkpoint(tmp_path):
    line = run_refused(spec_file(tmp_path, checkpoint={"load": f"megatron:{tmp_path / 'nope'}"}))
    assert "checkpoint.load megatron:" in line and "no such directory" in line
    (tmp_path / "empty").mkdir()
    line = run_refused(spec_file(tmp_path, checkpoint={"load": f"megatron:{tmp_path / 'empty'}"}))
    assert "is not a Megatron-Core torch_dist checkpoint" in line and "metadata.json" in line


def test_export_refuses_a_missing_checkpoint(tmp_path):
    line = refused("export", str(tmp_path / "nope"), "--format", "megatron", str(tmp_path / "out"))
    assert line.startswith("raytron export: error:") and not (tmp_path / "out").exists()
