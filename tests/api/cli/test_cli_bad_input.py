"""Bad input is refused before anything starts: exit status 2 and one line naming the field,
the file and the fix (the real console script, as a new user would run it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers.cli import refused, run_refused, spec_file  # noqa: F401

pytestmark = pytest.mark.procs  # runs the raytron command in a subprocess


def test_token_file_of_floats(tmp_path):
    np.save(tmp_path / "floats.npy", np.random.rand(1000))
    line = run_refused(spec_file(tmp_path, training={"data": str(tmp_path / "floats.npy")}))
    assert "training.data" in line and "float64 values, not token ids" in line and "astype" in line


def test_negative_token_ids(tmp_path):
    np.save(tmp_path / "neg.npy", np.arange(-5, 995))
    line = run_refused(spec_file(tmp_path, training={"data": str(tmp_path / "neg.npy")}))
    assert "training.data" in line and "negative token id -5" in line


def test_data_path_that_is_a_directory(tmp_path):
    (tmp_path / "corpus.bin").mkdir()
    line = run_refused(spec_file(tmp_path, training={"data": str(tmp_path / "corpus.bin")}))
    assert "training.data" in line and "is a directory" in line


@pytest.mark.parametrize("text, needles", [
    ("", ["the job spec is empty"]),
    ("training: {lr: .inf}\n", ["training.lr", "finite"]),
    ("parallel: {tensor_model_parallel_size: '2'}\n", ["parallel.tensor_model_parallel_size", "got '2'"]),
    ("parallel: {tensor_model_parallel_size: true}\n", ["parallel.tensor_model_parallel_size", "got True"]),
    ("resources: {num_nodes: 1000000000}\n", ["world_size", "at most 65536"]),
    ("model: {hidden_size: 1048576}\n", ["GiB per rank", "hidden_size"]),
    ("checkpoint: {save_interval: 0}\n", ["checkpoint.save_interval", "greater than or equal to 1"]),
    ("resources: {min_nodes: 9}\n", ["resources.min_nodes 9 >"]),
])
def test_spec_values(tmp_path, text, needles):
    line = run_refused(spec_file(tmp_path, text=text))
    for needle in needles:
        assert needle in line, line


def test_grid_world_size_is_capped_before_enumerating():
    line = refused("grid", "--world-size", "1000000000", "--json")
    assert "--world-size 1000000000" in line and "at most 65536" in line


def test_fault_syntax_and_rank(tmp_path):
    path = spec_file(tmp_path)
    assert "RANK@ITER" in refused("run", path, "--fault", "3", "--launcher", "processes")
    assert "kind must be one of raise, exit, hang" in refused("run", path, "--fault", "0@1:boom")
    assert "rank 5 is outside the job's 1 ranks" in refused("run", path, "--fault", "5@1", "--launcher", "processes")


def test_serve_fault_syntax(tmp_path):
    """The server's drills are parsed as run's, before anything (a store, a cluster) starts."""
    line = refused("serve", "--fault", "bogus", "--data-dir", str(tmp_path / "data"))
    assert "--fault" in line and "RANK@ITER[:raise|exit|hang|save]" in line, line
    line = refused("serve", "--fault", "1@2:exit", "--fault", "0@1:boom", "--data-dir", str(tmp_path / "data"))
    assert "--fault" in line and "kind must be one of raise, exit, hang, save" in line, line
    assert not (tmp_path / "data").exists()


def test_moe_routing_groups_that_do_not_fit(tmp_path):
    """MoE routing (issue 21): group-limited routing whose chosen groups hold fewer experts than top-k."""
    line = run_refused(spec_file(tmp_path, model={
        "num_moe_experts": 8, "moe_router_topk": 4, "moe_router_score_function": "sigmoid",
        "moe_router_num_groups": 4, "moe_router_group_topk": 1}))
    assert "moe_router_topk 4 > moe_router_group_topk 1 x experts per group 2" in line and "raise group_topk" in line
