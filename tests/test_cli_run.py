"""`raytron run --launcher processes` as a user runs it (real console script, real processes)."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from parity import tiny_spec

BIN = Path(sys.executable).parent
RAYTRON = str(BIN / "raytron")


def _spec_file(tmp_path, world=2, **kw):
    spec = tiny_spec(world=world, **kw)
    spec["training"]["train_iters"] = 3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_run_processes_json(tmp_path):
    path = _spec_file(tmp_path, world=2, parallel={"tensor_model_parallel_size": 2})
    p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["state"] == "SUCCEEDED" and out["iterations"] == 3 and len(out["losses"]) == 3
    assert out["world_size"] == 2 and out["sizes"]["tp"] == 2 and out["restarts"] == 0
    assert [r["rank"] for r in out["placement"]] == [0, 1]
    assert {r["tp"] for r in out["placement"]} == {0, 1}
    assert len({r["pid"] for r in out["placement"]}) == 2
    assert set(out["placement"][0]) == {"rank", "node_id", "pid", "tp", "pp", "dp", "cp", "ep"}
    assert "it/s" not in p.stderr  # no progress bar with --json


def test_run_processes_shows_plan_and_progress(tmp_path):
    path = _spec_file(tmp_path, world=2)
    p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "placement plan" in p.stderr and "3/3" in p.stderr  # the tqdm bar reached the end
    assert "SUCCEEDED after 3 iterations" in p.stdout


def test_invalid_spec_exits_2_before_anything_starts(tmp_path):
    spec = tiny_spec(world=3, parallel={"tensor_model_parallel_size": 2})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "world_size 3" in lines[0] and "tp(2)" in lines[0]


def test_missing_spec_file_exits_2(tmp_path):
    p = subprocess.run([RAYTRON, "run", str(tmp_path / "nope.yaml"), "--launcher", "processes"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot read spec" in p.stderr


def test_same_entry_point_under_torchrun(tmp_path):
    path = _spec_file(tmp_path, world=2, parallel={"pipeline_model_parallel_size": 2})
    from workers.spawn import free_port

    p = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                        "--master-port", str(free_port()), RAYTRON, "run", str(path), "--launcher", "processes",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    ref = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out["losses"] == json.loads(ref.stdout.strip().splitlines()[-1])["losses"]
    assert out["sizes"]["pp"] == 2
