"""`raytron run --launcher processes` as a user runs it (real console script, real processes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.drills import run_locally
from tests.helpers.parity import tiny_spec

pytestmark = pytest.mark.procs

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
    from workers.rank.distributed import free_port

    p = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                        "--master-port", str(free_port()), RAYTRON, "run", str(path), "--launcher", "processes",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["losses"] == run_locally(yaml.safe_load(path.read_text()))["losses"]  # in this process
    assert out["sizes"]["pp"] == 2


# -- failure drills, failures and signals through the CLI (process launcher) --------------------------

DRILL = {"parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}


def _drill_spec(tmp_path, max_restarts, iters=4, name="job.yaml"):
    spec = tiny_spec(world=4, **DRILL)
    spec["training"]["train_iters"] = iters
    spec["fault_tolerance"] = {"max_restarts": max_restarts, "collective_timeout_s": 20}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


def _json_run(path, *extra):
    p = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--json", *extra],
                       capture_output=True, text=True, timeout=300)
    return p, json.loads(p.stdout.strip().splitlines()[-1])


def test_fault_exit_restarts_to_the_undisturbed_curve(tmp_path):
    path = _drill_spec(tmp_path, max_restarts=1)
    ref = run_locally(yaml.safe_load(path.read_text()))  # the undisturbed run, in this process
    assert ref["restarts"] == 0
    p, out = _json_run(path, "--fault", "1@3:exit")
    assert p.returncode == 0, p.stderr
    assert out["state"] == "SUCCEEDED" and out["restarts"] == 1 and len(out["losses"]) == 4
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(out["losses"], ref["losses"]))
    assert "rank 1 (node 0" in p.stderr and "died" in p.stderr  # the failure event, one line


def test_max_restarts_zero_fails_with_exit_1_naming_the_rank(tmp_path):
    path = _drill_spec(tmp_path, max_restarts=0)
    p, out = _json_run(path, "--fault", "1@3:exit")
    assert p.returncode == 1 and out["state"] == "FAILED" and out["iterations"] == 2
    assert out["error"].startswith("rank 1 (node 0") and "tp 1, pp 0" in out["error"]
    assert "Traceback" not in p.stderr
    q = subprocess.run([RAYTRON, "run", str(path), "--launcher", "processes", "--fault", "1@3:raise"],
                       capture_output=True, text=True, timeout=300)
    assert q.returncode == 1 and "FAILED after 2 iterations" in q.stdout.strip().splitlines()[-1]
    assert q.stderr.strip().splitlines()[-1].startswith("error: rank 1 (") and "Traceback" not in q.stderr


def test_non_finite_loss_fails_and_json_has_no_bare_nan(tmp_path):
    spec = tiny_spec(world=1, training={"lr": 1e30, "train_iters": 4})
    path = tmp_path / "nan.yaml"
    path.write_text(yaml.safe_dump(spec))
    p, out = _json_run(path)
    # the first non-finite metric names the job's failure: with lr 1e30 the gradient norm of
    # iteration 2 overflows before its loss does (the controller tests cover each metric alone)
    assert p.returncode == 1 and out["state"] == "FAILED" and "grad norm is nan (not finite)" in out["error"]
    assert "NaN" not in p.stdout and "Infinity" not in p.stdout
    assert f"iteration {out['iterations'] + 1}:" in out["error"]


def _survivors(tag: str) -> list[int]:
    """Processes that inherited the test's tag (the CLI's ranks, forkserver, ...)."""
    out = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"RAYTRON_TEST_TAG={tag}".encode() in env.read_bytes():
                out.append(int(env.parent.name))
        except OSError:
            pass
    return out


def _signal_run(path, sig, after: str):
    import os
    import signal as signals
    import time
    import uuid

    tag = uuid.uuid4().hex
    err = path.parent / f"err-{tag}.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([RAYTRON, "run", str(path), "--launcher", "processes"], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, env={**os.environ, "RAYTRON_TEST_TAG": tag})
        deadline = time.monotonic() + 120
        while after not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0 if after == "node_id" else 0.0)
        proc.send_signal(getattr(signals, sig))
        out, _ = proc.communicate(timeout=60)
    for _ in range(50):  # the forkserver leaves when its parent has gone
        if not _survivors(tag):
            break
        time.sleep(0.1)
    return proc.returncode, out, err.read_text(), _survivors(tag)


def test_sigterm_during_a_run_cancels_with_exit_143(tmp_path):
    code, out, err, left = _signal_run(_drill_spec(tmp_path, 0, iters=500), "SIGTERM", after="node_id")  # ranks up
    assert code == 143 and "CANCELLED" in out and "(cancelled by SIGTERM)" in out and len(out.splitlines()) == 1
    assert "Traceback" not in err and "FAILED" not in out and left == []


def test_sigint_during_start_up_cancels_with_exit_130(tmp_path):
    code, out, err, left = _signal_run(_drill_spec(tmp_path, 0, iters=500), "SIGINT", after="placement plan")  # ranks starting
    assert code == 130 and "CANCELLED" in out and "(cancelled by SIGINT)" in out
    assert "Traceback" not in err and left == []
