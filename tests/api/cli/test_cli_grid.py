"""`raytron grid` as a user runs it: the real console script in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.procs  # runs the raytron command in a subprocess

RAYTRON = str(Path(sys.executable).with_name("raytron"))


def run(*args):
    return subprocess.run([RAYTRON, *args], capture_output=True, text=True, timeout=60)


def test_acceptance_json_world16():
    p = run("grid", "--world-size", "16", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["world_size"] == 16
    assert out["sizes"] == {"tp": 2, "pp": 2, "cp": 2, "ep": 1, "etp": 2, "dp": 2, "expert_dp": 4}
    d = out["decoder"]
    assert d["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert d["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert d["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert d["pp"] == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert set(d) == {"tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-cp", "tp-dp", "tp-dp-cp"}
    assert set(out["expert"]) == {"tp", "ep", "tp-ep", "tp-ep-pp", "dp", "pp"}
    assert out["embedding"][0] == [0, 8] and out["position_embedding"][0] == [0]
    assert out["ranks"][0] == {"rank": 0, "tp": 0, "cp": 0, "dp": 0, "pp": 0, "ep": 0, "etp": 0,
                               "expert_dp": 0, "node": 0, "local": 0}
    assert out["ranks"][9]["node"] == 1 and out["ranks"][9]["local"] == 1  # 8 GPUs per node by default


def test_short_aliases_and_table():
    p = run("grid", "--world-size", "8", "--tp", "2", "--pp", "2", "--gpus-per-node", "4", "--order", "dp-tp-pp")
    assert p.returncode == 0, p.stderr
    assert "decoder groups:" in p.stdout and "tp        [0,2] [1,3] [4,6] [5,7]" in p.stdout


def test_invalid_world_size_exits_2_with_one_line():
    p = run("grid", "--world-size", "10", "--tensor-model-parallel-size", "4")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "world_size 10" in lines[0] and "= 4" in lines[0] and "multiple of 4" in lines[0]
    assert p.stdout == ""


def test_bad_flag_value_exits_2():
    p = run("grid", "--world-size", "-3")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    p = run("grid", "--world-size", "16", "--tp", "16", "--gpus-per-node", "8")
    assert p.returncode == 2 and "larger than gpus_per_node 8" in p.stderr, p.stderr


def test_grid_path_imports_neither_torch_nor_ray():
    code = ("import sys; from api.cli.main import main; main(['grid','--world-size','8','--tp','2','--json']);"
            "sys.stderr.write(str(('torch' in sys.modules, 'ray' in sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert p.returncode == 0 and p.stderr.endswith("(False, False)"), p.stderr
