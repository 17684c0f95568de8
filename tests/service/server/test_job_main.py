"""Server-wide failure drills (`raytron serve --fault`) on their way to a job: serve's flags ->
the launcher -> the runner's command line (:func:`service.server.runners.runner_command`) -> the
runner's parser (:mod:`service.server.job_main`) -> the job's controller. The Ray Jobs path end to end
is in test_serve_faults.py; here the plumbing, and one runner started with the command line a
launcher writes (local rank processes, seconds).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from api.cli.main import build_parser as cli_parser
from api.cli.serve_cmd import build_app
from service.server.job_main import build_parser, drills_for
from service.server.runners import runner_command
from service.server.store import JobStore, sqlite_url
from workers.rank.faults import KINDS, Fault

from tests.helpers.drills import run_locally
from tests.helpers.paths import ROOT


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_round_trips_through_its_text(kind):
    fault = Fault(3, 6, kind)
    assert str(fault) == f"3@6:{kind}" and Fault.parse(str(fault)) == fault
    assert str(Fault.parse("1@2")) == "1@2:raise"


def test_runner_command_carries_the_drills_to_job_main():
    faults = [Fault(3, 6, "save"), Fault(0, 2), Fault(1, 4, "hang")]
    cmd = runner_command("job-1", "/data", "sqlite:////data/raytron.db", launcher="ray", faults=faults)
    assert cmd[1:3] == ["-m", "service.server.job_main"]
    args = build_parser().parse_args(cmd[3:])
    assert args.fault == faults and args.launcher == "ray" and args.job_id == "job-1"
    assert args.data_dir == "/data" and args.database_url == "sqlite:////data/raytron.db"
    assert build_parser().parse_args(runner_command("job-1", "/data", "sqlite://")[3:]).fault == []


def test_drills_outside_a_jobs_ranks_are_left_out():
    faults = [Fault(3, 6, "save"), Fault(0, 2), Fault(2, 1, "exit")]
    assert drills_for(faults, 4) == (faults, [])
    assert drills_for(faults, 2) == ([Fault(0, 2)], [Fault(3, 6, "save"), Fault(2, 1, "exit")])


def test_serve_fault_flags_reach_the_launcher(tmp_path):
    args = cli_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--launcher", "processes",
                                    "--fault", "3@6:save", "--fault", "1@2"])
    app, store = build_app(args)
    try:
        assert app.state.runners.faults == [Fault(3, 6, "save"), Fault(1, 2)]
    finally:
        store.close()
    args = cli_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--launcher", "processes"])
    app, store = build_app(args)
    store.close()
    assert app.state.runners.faults == []


@pytest.mark.procs
def test_a_runner_fires_the_drills_inside_its_job_and_leaves_out_the_others(tmp_path):
    """The runner started as a launcher starts it: rank 1 dies writing the checkpoint of iteration 2,
    rank 5's drill is outside the job's 2 ranks and must not break it."""
    spec = {"name": "drilled",
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                      "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 16},
            "parallel": {"tensor_model_parallel_size": 2},
            "training": {"train_iters": 3, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-3, "seed": 7},
            "checkpoint": {"save_interval": 1},
            "resources": {"num_nodes": 1, "gpus_per_node": 2},
            "fault_tolerance": {"max_restarts": 1, "collective_timeout_s": 30}}
    url = sqlite_url(tmp_path)
    store = JobStore(url)
    try:
        store.create_job(spec, job_id="drilled-1")
        cmd = runner_command("drilled-1", tmp_path, url, faults=[Fault(1, 2, "save"), Fault(5, 1, "exit")])
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        assert "left out (rank outside the job's 2 ranks): 5@1:exit" in p.stdout, p.stdout[-4000:]
        job = store.get_job("drilled-1")
        assert job["state"] == "SUCCEEDED", job
        failures = [e["data"] for e in store.events("drilled-1", kind="failure")]
        assert len(failures) == 1 and failures[0]["rank"] == 1 and failures[0]["code"] == "rank_died", failures
        froms = [a["from_checkpoint"] for a in store.attempts("drilled-1")]
        assert froms[0] is None and froms[1].endswith("iter_0000001"), froms  # 2 was never committed
    finally:
        store.close()


def _runner_spec(name: str) -> dict:
    return {"name": name,
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
                      "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 16},
            "training": {"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-3, "seed": 7},
            "checkpoint": {"save_interval": 2, "keep_last": 3},
            "resources": {"num_nodes": 1, "gpus_per_node": 1},
            "fault_tolerance": {"max_restarts": 1, "collective_timeout_s": 30}}


def _run_runner(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.procs
def test_a_runner_started_again_goes_on_from_the_jobs_record(tmp_path):
    """The job's runner is killed (SIGKILL of its whole process group) mid-job; a runner started
    again for the job replays the store's events into its controller: one restart, resumed from
    the last checkpoint the record holds, the curve whole and equal to an undisturbed run's, every
    iteration recorded once. Fails if the runner ignores the record (it would start over at QUEUED
    from iteration 0 with restarts 0, or refuse to run a job that is not QUEUED)."""
    import signal
    import time

    url = sqlite_url(tmp_path)
    store = JobStore(url)
    try:
        undisturbed = {k: v for k, v in _runner_spec("whole").items() if k != "checkpoint"}
        reference = run_locally(undisturbed)["losses"]  # the same job undisturbed, in this process
        assert len(reference) == 10

        store.create_job(_runner_spec("killed"), job_id="killed-1")
        first = subprocess.Popen(runner_command("killed-1", tmp_path, url), cwd=ROOT, start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while store.get_job("killed-1")["iteration"] < 5 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
        assert first.poll() is None, "the first runner ended before it could be killed"
        os.killpg(first.pid, signal.SIGKILL)  # the runner and its ranks, as a lost machine would
        first.wait(timeout=30)
        killed_at = store.get_job("killed-1")["iteration"]
        assert 5 <= killed_at < 10 and store.get_job("killed-1")["state"] == "RUNNING"

        p = _run_runner(runner_command("killed-1", tmp_path, url))
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
        assert "going on from its" in p.stdout
        job = store.get_job("killed-1")
        assert job["state"] == "SUCCEEDED", job
        metrics = store.metrics("killed-1")
        assert [m["iteration"] for m in metrics] == list(range(1, 11))
        assert max(abs(m["loss"] - r) for m, r in zip(metrics, reference)) <= 1e-6, (metrics, reference)
        restarting = [e for e in store.events("killed-1") if e["kind"] == "state" and e["state"] == "RESTARTING"]
        assert len(restarting) == 1 and "the controller was restarted" in restarting[0]["message"]
        froms = [a["from_checkpoint"] for a in store.attempts("killed-1")]
        assert len(froms) == 2 and froms[0] is None and froms[1].endswith(f"iter_{killed_at // 2 * 2:07d}"), froms
        seqs = [e["seq"] for e in store.events("killed-1")]
        assert seqs == list(range(1, len(seqs) + 1))  # every event once, in order
    finally:
        store.close()
