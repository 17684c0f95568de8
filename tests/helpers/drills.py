"""Failure drills on a served simulated cluster: a Ray server and client, the undisturbed curve to compare with, and the story a job's events tell."""

from __future__ import annotations

import json
import os
import time

import pytest

from service.control.jobs import start_job
from service.ranks.proc_tree import matching
from service.ranks.process_launcher import ProcessLauncher
from service.spec.spec import parse_spec, to_job_config
from tests.helpers.server import Server

MODEL = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 64}


DONE = ("SUCCEEDED", "FAILED", "CANCELLED")


def spec(name, *, nodes=2, gpus=2, tp=2, iters=12, gbs=8, save_interval=2, min_nodes=None, max_restarts=3,
         timeout=300, grace=60.0) -> dict:
    return {"name": name, "model": MODEL, "parallel": {"tensor_model_parallel_size": tp},
            "training": {"train_iters": iters, "global_batch_size": gbs, "micro_batch_size": 1, "lr": 3e-3},
            "checkpoint": {"save_interval": save_interval},
            "resources": {"num_nodes": nodes, "gpus_per_node": gpus, "min_nodes": min_nodes},
            "fault_tolerance": {"max_restarts": max_restarts, "collective_timeout_s": timeout,
                                "node_grace_s": grace}}


# What a failure drill only times, not computes: jobs that differ in these alone have one curve.
_TIMING = ("collective_timeout_s", "node_grace_s", "max_restarts")
_curves: dict[str, list[float]] = {}


def undisturbed(s: dict, *, one_rank: bool = False) -> list[float]:
    """The job's loss curve on local processes, without checkpoints or failures; computed once per
    session for specs that differ only in their name, checkpoints or failure handling's timing.
    ``one_rank``: on one rank (tp 1, dp 1, every micro-batch of the global batch on it): the same
    curve by layout invariance, for a fraction of the CPU of the job's own layout (measured
    2026-12-07, 2-core CPU VM: 4x2 tp 2, 24 iterations, 2.0 s against 8.0 s, within 2e-7
    relative). Drift between layouts grows with the iterations (1.8e-6 after 36 of them against
    tp 2 x dp 2): for comparisons at 1e-5 of a few dozen iterations, not at 1e-6."""
    if one_rank:
        s = {**s, "parallel": {}, "resources": {"num_nodes": 1, "gpus_per_node": 1}}
    ft = {k: v for k, v in (s.get("fault_tolerance") or {}).items() if k not in _TIMING}
    key = json.dumps({**s, "name": None, "checkpoint": None, "fault_tolerance": ft}, sort_keys=True)
    if key not in _curves:
        _curves[key] = run_locally({**s, "checkpoint": {}})["losses"]
    return list(_curves[key])


def run_locally(s: dict) -> dict:
    """The spec's job on local processes in this process, without faults: the result that
    ``raytron run --launcher processes --json`` prints (the same start_job and launcher) without a
    second interpreter; it must succeed."""
    result = start_job(to_job_config(parse_spec(s)), launcher=ProcessLauncher(), background=False).run()
    assert result["state"] == "SUCCEEDED", result
    return result


def close(a, b, rel=1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def story(api, job_id: str, losses: list[float], expected: list[float]) -> str:
    """Why two curves differ, with the job's events (an assertion message)."""
    first = next((i for i, (x, y) in enumerate(zip(losses, expected)) if abs(x - y) > 1e-5 * abs(y)), None)
    lines = [f"{len(losses)} losses vs {len(expected)} expected; first difference at index {first}: "
             f"{None if first is None else (losses[first], expected[first])}"]
    for e in events(api, job_id):
        if e["kind"] == "iteration":
            lines.append(f"  iteration {e['data']['iteration']} loss {e['data']['loss']!r}")
        elif e["kind"] == "placement":
            lines.append(f"  placement {[(p['rank'], p.get('reused'), p.get('resumed_iteration')) for p in e['data']['placement']]}")
        else:
            lines.append(f"  {e['kind']} {e['state']} {e['message'][:200]}")
    return "\n".join(lines)


def ray_server_client(tmp_path_factory, name: str, simulate: str = "4x2", extra_args: tuple[str, ...] = (),
                      with_server: bool = False):
    """The body of a module's server fixture: `raytron serve --simulate SHAPE --launcher ray` in a
    fresh data dir (``extra_args``: more serve flags); yields its API client (``with_server``: the
    server and its client), then stops it and every runner it left."""
    srv = Server(tmp_path_factory.mktemp(name) / "data", simulate=simulate, launcher="ray",
                 start_timeout_s=180, extra_args=extra_args).start()
    try:
        with srv.client() as client:
            yield (srv, client) if with_server else client
    finally:
        srv.stop()
        srv.kill_runners()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    yield from ray_server_client(tmp_path_factory, "serve4x2")


def submit(api, s: dict) -> str:
    r = api.post("/jobs", json=s)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def wait_iteration(api, job_id: str, at_least: int, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = api.get(f"/jobs/{job_id}").json()
        if job["state"] == "RUNNING" and (job.get("iteration") or 0) >= at_least:
            return job
        assert job["state"] not in DONE, job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not reach iteration {at_least}")


def events(api, job_id: str) -> list[dict]:
    return api.get(f"/jobs/{job_id}/events").json()["events"]


def failures(api, job_id: str) -> list[dict]:
    return [e["data"] for e in events(api, job_id) if e["kind"] == "failure"]


def _raylet_of(node_id: str) -> tuple[int, bool]:
    """The pid of the raylet of Ray node ``node_id`` on this machine, and whether it is the head's."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv and argv[0].endswith("raylet") and f"--node_id={node_id}" in argv:
            socket = next(a for a in argv if a.startswith("--raylet_socket_name="))
            return int(pid), socket.endswith("/raylet")
    raise AssertionError(f"no raylet of node {node_id}")


def processes_named(*argv_prefix: str) -> list[int]:
    """Pids whose argv starts with a program ending in ``argv_prefix[0]`` followed by the rest."""
    return matching(lambda argv: argv[0].endswith(argv_prefix[0])
                    and argv[1:len(argv_prefix)] == list(argv_prefix[1:]))


def whole_and_once(api, job_id: str) -> list[dict]:
    """The job's events, after checking each sequence number is there once, in order."""
    log = events(api, job_id)
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    return log
