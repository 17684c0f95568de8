"""The CLI client (`raytron submit/status/logs/cancel/plan`) against a real server, as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import yaml

from tests.helpers.paths import ROOT
from tests.helpers.server import TOKEN, server, tiny  # noqa: F401 - `server` is the module's fixture

pytestmark = pytest.mark.procs  # a real server process (and its job runners)


def raytron(srv, *args, token_dir=None, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in ("RAYTRON_API_TOKEN", "RAYTRON_SERVER")}
    extra = ["--server", srv.url]
    if token_dir is None:
        env["RAYTRON_API_TOKEN"] = TOKEN
    else:
        extra += ["--data-dir", str(token_dir)]
    return subprocess.run([sys.executable, "-m", "api.cli.client_cmds", *args, *extra], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def write(tmp_path, spec, name="job.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_submit_follow_status_logs(server, tmp_path):
    token_dir = tmp_path / "client"
    token_dir.mkdir()
    (token_dir / "api_token").write_text(TOKEN + "\n")  # the token file `raytron serve` writes
    p = raytron(server, "submit", write(tmp_path, tiny("cli", world=1, iters=3)), "-f", token_dir=token_dir)
    assert p.returncode == 0, p.stderr
    job_id, state = p.stdout.split()[-2:]
    assert state == "SUCCEEDED"
    assert "3/3" in p.stderr and "loss=" in p.stderr and "tok_s=" in p.stderr  # the live bar reached the end

    table = raytron(server, "status")
    assert table.returncode == 0 and job_id in table.stdout and "SUCCEEDED" in table.stdout
    one = json.loads(raytron(server, "status", job_id, "--json").stdout)
    assert one["iteration"] == 3 and one["loss"] > 0 and one["placement"][0]["rank"] == 0
    assert "losses" not in one  # the curve is at /jobs/{id}/metrics, not in every status
    text = raytron(server, "status", job_id).stdout
    assert "SUCCEEDED, iteration 3/3" in text and "node_id" in text and f"-> {one['loss']:.4f}" in text
    logs = raytron(server, "logs", job_id)
    assert logs.returncode == 0 and "iteration 3 loss" in logs.stdout
    assert "iteration 3 loss" in raytron(server, "logs", job_id, "-f").stdout
    # `submit -f --json`: every event once, in order, ending with the final state
    p = raytron(server, "submit", write(tmp_path, tiny("cli-json", world=1, iters=2)), "-f", "--json")
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert [e["seq"] for e in lines] == list(range(1, len(lines) + 1)) and lines[-1]["state"] == "SUCCEEDED"
    # `status -f` follows from now on: an ended job has nothing new (its history is not sent again)
    again = raytron(server, "status", job_id, "-f", "--json")
    assert again.returncode == 0 and again.stdout == ""  # mutation: followed from seq 0 -> every event again


def test_followed_job_that_fails_exits_1(server, tmp_path):
    spec = tiny("doomed", world=1, iters=2)
    spec["training"]["data"] = str(tmp_path / "missing.npy")  # valid form, fails when the ranks load it
    p = raytron(server, "submit", write(tmp_path, spec), "-f")
    assert p.returncode == 1, p.stderr  # mutation: follow() returns 0 always
    assert p.stdout.split()[-1] == "FAILED"


def test_bad_input_exits_2_with_one_line(server, tmp_path):
    bad = tiny("bad", world=1)
    bad["parallel"] = {"tensor_model_parallel_size": 2}
    for args in (("submit", write(tmp_path, bad)), ("submit", str(tmp_path / "nope.yaml")),
                 ("cancel", "no-such-job"), ("status", "no-such-job"), ("plan", write(tmp_path, bad))):
        p = raytron(server, *args)
        assert p.returncode == 2, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = raytron(server, "status", token_dir=tmp_path / "empty")  # no token anywhere: 401 is not bad input
    assert p.returncode == 1 and "unauthorized" in p.stderr


def test_plan_here_and_on_the_server_agree(server, tmp_path):
    path = str(ROOT / "examples" / "tiny-5d.yaml")
    here = raytron(server, "plan", path, "--json")
    local = subprocess.run([sys.executable, "-m", "api.cli.client_cmds", "plan", path, "--json"], capture_output=True,
                           text=True, cwd=ROOT, timeout=60)
    assert json.loads(here.stdout) == json.loads(local.stdout)
    assert json.loads(local.stdout)["traffic"]["tp"]["cross_node"] == 0
    table = subprocess.run([sys.executable, "-m", "api.cli.client_cmds", "plan", path], capture_output=True, text=True,
                           cwd=ROOT, timeout=60).stdout
    assert "traffic/iteration" in table and "w/ dist-opt" in table


def test_the_client_does_not_import_the_server_command():
    """``raytron submit/status/...`` load the HTTP client only: the data dir default it shares with
    ``raytron serve`` lives in api/cli/data_dir.py, not in the serve command."""
    p = subprocess.run([sys.executable, "-c", "import sys, api.cli.client, api.cli.client_cmds; "
                        "print(sorted(m for m in sys.modules if m in ('api.cli.serve_cmd', 'api.rest.app', 'uvicorn')))"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr  # mutation: client imports serve_cmd again
