"""The REST API against a real server: `python -m api.cli.serve_cmd` (uvicorn) on a free port, a real
SQLite file, jobs run by the local process launcher (world 1-2, tiny models).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from workers.rank.distributed import free_port

pytestmark = pytest.mark.procs  # a real server process (and its job runners)

from tests.helpers.paths import ROOT
from tests.helpers.server import Server, TOKEN, api, pid_alive, server, tiny, wait_for  # noqa: F401


# ---- auth -----------------------------------------------------------------------------------------

def test_token_required_everywhere_but_healthz(server):
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    for method, path in [("GET", "/api/v1/jobs"), ("POST", "/api/v1/jobs"), ("GET", "/api/v1/jobs/x"),
                         ("GET", "/api/v1/cluster"), ("POST", "/api/v1/plan"), ("GET", "/api/v1/job-states"),
                         ("GET", "/metrics")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)  # mutation: auth dependency dropped
            assert r.json()["code"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
            assert TOKEN not in r.text
    assert httpx.get(f"{server.url}/api/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_token_file_created_0600_and_never_printed(tmp_path):
    srv = Server(tmp_path / "d", token=None).start()
    try:
        path = tmp_path / "d" / "api_token"
        assert path.stat().st_mode & 0o777 == 0o600  # mutation: default umask mode -> 0644
        token = path.read_text().strip()
        assert len(token) >= 32
        with srv.client(token) as c:
            assert c.get("/jobs").status_code == 200
        assert httpx.get(f"{srv.url}/api/v1/jobs", headers={"Authorization": "Bearer x" + token}).status_code == 401
    finally:
        srv.stop()
        srv.kill_runners()
    assert token not in srv.log.read_text()
    again = Server(tmp_path / "d", token=None).start()  # a restart keeps the token
    try:
        with again.client(token) as c:
            assert c.get("/jobs").status_code == 200
    finally:
        again.stop()


# ---- invalid requests ------------------------------------------------------------------------------

INVALID = [
    ("world", {"resources": {"num_nodes": 1, "gpus_per_node": 3}, "parallel": {"tensor_model_parallel_size": 2}},
     "resources.num_nodes", ["world_size 3", "tp(2)"]),
    ("tp_node", {"resources": {"num_nodes": 2, "gpus_per_node": 2}, "parallel": {"tensor_model_parallel_size": 4},
                 "training": {"global_batch_size": 4}}, "parallel.tensor_model_parallel_size", ["4 > ", "gpus_per_node 2"]),
    ("heads", {"model": {"num_attention_heads": 3, "hidden_size": 48, "num_query_groups": 3},
               "parallel": {"tensor_model_parallel_size": 2}, "resources": {"gpus_per_node": 2}},
     "model.num_attention_heads", ["heads 3", "tensor_model_parallel_size 2"]),
    ("layers", {"model": {"num_layers": 3}, "parallel": {"pipeline_model_parallel_size": 2},
                "resources": {"gpus_per_node": 2}}, "model.num_layers", ["num_layers 3", "= 2"]),
    ("vpp", {"parallel": {"virtual_pipeline_model_parallel_size": 2}}, "parallel.virtual_pipeline_model_parallel_size",
     ["pipeline_model_parallel_size"]),
    ("seq_cp", {"model": {"seq_length": 18}, "parallel": {"context_parallel_size": 2},
                "resources": {"gpus_per_node": 2}}, "model.seq_length", ["18", "= 4"]),
    ("experts", {"model": {"num_moe_experts": 3}, "parallel": {"expert_model_parallel_size": 2},
                 "resources": {"gpus_per_node": 2}}, "model.num_moe_experts", ["3", "expert_model_parallel_size 2"]),
    ("moe_groups", {"model": {"num_moe_experts": 4, "moe_router_topk": 2, "moe_router_score_function": "sigmoid",
                              "moe_router_num_groups": 2, "moe_router_group_topk": 3}},
     "model.moe_router_group_topk", ["group_topk 3 > moe_router_num_groups 2"]),
    ("batch", {"training": {"global_batch_size": 5, "micro_batch_size": 1}, "resources": {"gpus_per_node": 2}},
     "training.global_batch_size", ["5", "dp 2", "multiple of 2"]),
    ("order", {"parallel": {"order": "tp-tp-dp"}}, "parallel.order", ["repeated"]),
    ("mla_gqa", {"model": {"multi_latent_attention": True, "num_query_groups": 2}}, "model.num_query_groups",
     ["num_query_groups 2", "multi_latent_attention", "drop model.num_query_groups"]),
    ("unknown", {"modle": {}}, "modle", ["unknown field"]),
    ("type", {"model": {"hidden_size": "big"}}, "model.hidden_size", ["integer"]),
    ("bounds", {"resources": {"num_nodes": 10**9, "gpus_per_node": 8}}, "resources", ["8000000000", "65536"]),
    ("priority", {"priority": "high"}, "priority", ["integer"]),
]


@pytest.mark.parametrize("name,patch,field,words", INVALID, ids=[i[0] for i in INVALID])
def test_each_invalid_spec_is_a_422_with_its_field_and_numbers(api, name, patch, field, words):
    spec = tiny(world=1)
    for key, value in patch.items():
        spec[key] = {**spec[key], **value} if isinstance(spec.get(key), dict) and isinstance(value, dict) else value
    for path in ("/jobs", "/plan"):
        r = api.post(path, json=spec)
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["code"] == "invalid_spec"
        entry = next((e for e in body["errors"] if e["field"] == field), None)
        assert entry is not None, body  # mutation: field path guessed from the first word -> wrong path
        for word in words:
            assert word in entry["message"], entry
    assert api.get("/jobs", params={"limit": 1000}).json()["count"] == len(
        [j for j in api.get("/jobs", params={"limit": 1000}).json()["jobs"]])  # nothing stored is a 422's


def test_one_entry_per_problem(api):
    spec = tiny(world=3)
    spec["model"]["hidden_size"] = 30
    spec["parallel"] = {"tensor_model_parallel_size": 4}
    r = api.post("/jobs", json=spec)
    errors = r.json()["errors"]
    # world 3 vs tp 4, tp 4 > 3 GPUs per node, hidden 30 vs 4 heads, odd head dim, heads/groups vs tp, ffn vs tp
    assert r.status_code == 422 and len(errors) >= 5  # mutation: spec_problems joined into one entry -> 1
    assert len({e["message"] for e in errors}) == len(errors)


def test_malformed_requests_are_4xx_json(server, api):
    assert api.post("/jobs", content=b"{not json").json()["code"] == "invalid_json"
    assert api.post("/jobs", content=b"{not json").status_code == 400
    assert api.post("/jobs", content=b"\xff\xfe").status_code == 400
    assert api.post("/jobs", json=[1, 2]).status_code == 422
    big = b'{"name": "' + b"a" * (2 << 20) + b'"}'
    r = api.post("/jobs", content=big)
    assert r.status_code == 413 and r.json()["code"] == "body_too_large"  # mutation: BodyLimit removed -> 422
    for method, path in [("GET", "/jobs/nope"), ("GET", "/jobs/nope/placement"), ("GET", "/jobs/nope/events"),
                         ("GET", "/jobs/nope/logs"), ("POST", "/jobs/nope/cancel"), ("GET", "/jobs/..%2F..%2Fetc/logs")]:
        r = api.request(method, path)
        assert r.status_code == 404 and r.json()["code"] in ("job_not_found", "not_found"), (path, r.text)
    assert api.get("/jobs", params={"limit": "many"}).status_code == 422
    assert api.get("/jobs", params={"state": "DONE"}).json()["code"] == "invalid_request"
    assert api.delete("/jobs").status_code == 405 and api.delete("/jobs").json()["code"] == "method_not_allowed"
    r = api.post("/jobs", json=tiny(world=4))  # valid, but the cluster has 1 node x 2 GPU slots
    assert r.status_code == 409 and r.json()["code"] == "never_fits"
    assert "needs 1 node(s) x 4 GPU slots" in r.json()["message"] and "1 node(s) x 2 GPU slots" in r.json()["message"]
    assert httpx.get(f"{server.url}/docs").status_code == 200
    assert "/api/v1/jobs/{job_id}/events" in httpx.get(f"{server.url}/openapi.json").json()["paths"]


# ---- jobs that run ---------------------------------------------------------------------------------

def _run_cli_losses(tmp_path, spec) -> list[float]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec.items() if k != "priority"}))
    p = subprocess.run([str(Path(sys.executable).parent / "raytron"), "run", str(path), "--launcher", "processes",
                        "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])["losses"]


def test_submit_runs_to_succeeded_with_the_cli_losses(server, api, tmp_path):
    spec = tiny("parity", world=2, iters=3, tensor_model_parallel_size=2)
    r = api.post("/jobs", json=spec)
    assert r.status_code == 201 and r.json()["state"] == "QUEUED"
    job_id = r.json()["id"]
    assert r.json()["sizes"]["tp"] == 2 and r.json()["world_size"] == 2
    job = wait_for(api, job_id, ("SUCCEEDED", "FAILED"))
    assert job["state"] == "SUCCEEDED", job
    curve = api.get(f"/jobs/{job_id}/metrics").json()
    assert curve["iterations"] == [1, 2, 3] and curve["next_after"] is None and curve["attempt"] == [1, 1, 1]
    assert curve["loss"] == pytest.approx(_run_cli_losses(tmp_path, spec), rel=1e-6)
    assert set(job["metric_names"]) >= {"loss", "lr", "tokens_per_s"} and set(curve) >= set(job["metric_names"])
    assert job["iteration"] == 3 and job["restarts"] == 0 and len(job["attempts"]) == 1
    assert job["loss"] == curve["loss"][-1] and job["tokens_per_s"] == curve["tokens_per_s"][-1] > 0
    assert job["error"] is None and "losses" not in job and job["last_seq"] == len(
        api.get(f"/jobs/{job_id}/events").json()["events"])

    placement = api.get(f"/jobs/{job_id}/placement").json()
    ranks = placement["ranks"]
    assert [p["rank"] for p in ranks] == [0, 1] and {p["tp"] for p in ranks} == {0, 1}
    assert len({p["pid"] for p in ranks}) == 2 and all(p["hostname"] for p in ranks) and placement["attempt"] == 1
    # as the ranks report it: node index in the attempt's plan, local slot on that node
    assert [(p["node"], p["local"]) for p in ranks] == [(0, 0), (0, 1)]

    events = api.get(f"/jobs/{job_id}/events").json()["events"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    states = [e["state"] for e in events if e["kind"] == "state"]
    assert states == ["QUEUED", "STARTING", "RUNNING", "SUCCEEDED"]
    assert [e["data"]["iteration"] for e in events if e["kind"] == "iteration"] == [1, 2, 3]
    assert [e["kind"] for e in api.get(f"/jobs/{job_id}/events", params={"kind": "placement"}).json()["events"]] \
        == ["placement"]

    logs = api.get(f"/jobs/{job_id}/logs")
    assert logs.status_code == 200 and "iteration 3 loss" in logs.text and "SUCCEEDED" in logs.text
    assert api.get(f"/jobs/{job_id}/logs", params={"offset": 10 ** 9}).text == ""
    for offset in (2**50, 2**53 - 1):  # past any file system's seek limit: empty, never a 500
        r = api.get(f"/jobs/{job_id}/logs", params={"offset": offset})
        assert r.status_code == 200 and r.text == "" and r.headers["x-log-offset"] == str(offset)
        with api.stream("GET", f"/jobs/{job_id}/logs", params={"offset": offset, "follow": "true"}) as r:
            assert r.status_code == 200 and r.read() == b""  # the followed stream ends whole (the job has ended)
    for offset in (2**53, 44434288718764080):  # beyond the documented bound: a 422 (was a 500: OSError)
        assert api.get(f"/jobs/{job_id}/logs", params={"offset": offset}).status_code == 422
    r = api.request("OPTIONS", "/jobs")  # two routes on one path: Allow names both
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"  # mutation: Starlette's Allow -> "POST"

    listed = api.get("/jobs").json()["jobs"]
    assert listed[0]["id"] == job_id and "losses" not in listed[0]
    # what the console's jobs page shows of a job, in the list itself (no request per job)
    assert (listed[0]["iteration"], listed[0]["loss"], listed[0]["restarts"], listed[0]["sizes"]) == (
        3, job["loss"], 0, job["sizes"]) and listed[0]["sizes"]["tp"] == 2
    assert api.get("/job-states").json() == {
        "states": ["QUEUED", "STARTING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED"],
        "terminal": ["SUCCEEDED", "FAILED", "CANCELLED"]}
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert 'raytron_jobs{state="SUCCEEDED"}' in metrics and "raytron_queue_length 0.0" in metrics
    assert f'raytron_job_loss{{job_id="{job_id}",name="parity"}} {job["loss"]}' in metrics
    assert f'raytron_job_iteration{{job_id="{job_id}",name="parity"}} 3.0' in metrics
    assert "raytron_job_tokens_per_second" in metrics and "raytron_job_restarts" in metrics
    cluster = api.get("/cluster").json()
    assert cluster["nodes"] == [{"node_id": "node-0", "gpus": 2, "gpus_used": 0, "gpus_free": 2, "alive": True,
                                 "accelerator": None}]
    assert cluster["gpu_type"] is None  # the simulated CPU cluster: no accelerator label
    assert api.post(f"/jobs/{job_id}/cancel").status_code == 409  # it has ended


def _sse(client: httpx.Client, job_id: str, last_event_id: int | None = None) -> list[tuple[str, str, dict]]:
    headers = {"Accept": "text/event-stream", **({"Last-Event-ID": str(last_event_id)} if last_event_id else {})}
    out, fields = [], {}
    with client.stream("GET", f"/jobs/{job_id}/events", headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                if fields:
                    out.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
                fields = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                fields[key] = value
    return out


def test_events_stream_live_until_the_end_and_resume(api):
    job_id = api.post("/jobs", json=tiny("sse", world=1, iters=4)).json()["id"]
    stream = _sse(api, job_id)  # opened while the job is queued: it follows the job live to its end
    assert stream[-1][1] == "end" and stream[-1][2]["state"] == "SUCCEEDED"  # mutation: no end event -> hangs
    seqs = [int(i) for i, _, _ in stream[:-1]]
    assert seqs == list(range(1, len(seqs) + 1))  # each event once, in order
    assert [d["state"] for _, kind, d in stream if kind == "state"] == ["QUEUED", "STARTING", "RUNNING", "SUCCEEDED"]
    assert sum(1 for _, kind, _ in stream if kind == "iteration") == 4
    resumed = _sse(api, job_id, last_event_id=seqs[-3])
    assert [int(i) for i, _, _ in resumed[:-1]] == seqs[-2:]  # mutation: Last-Event-ID ignored -> all again
    for bad in ("x", "null", "-1"):  # a declared integer header: a documented 422, never a 400 or 500
        r = api.get(f"/jobs/{job_id}/events", headers={"Accept": "text/event-stream", "Last-Event-ID": bad})
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", bad
    history = api.get(f"/jobs/{job_id}/events", params={"exclude_kind": "iteration"}).json()["events"]
    assert history and all(e["kind"] != "iteration" for e in history)


def test_logs_follow_streams_until_the_job_ends(api):
    job_id = api.post("/jobs", json=tiny("follow", world=1, iters=3)).json()["id"]
    with api.stream("GET", f"/jobs/{job_id}/logs", params={"follow": "true"}, timeout=120) as r:
        text = "".join(r.iter_text())
    assert "iteration 3 loss" in text and f"job {job_id} SUCCEEDED" in text
    assert api.get(f"/jobs/{job_id}").json()["state"] == "SUCCEEDED"


def test_cancel_stops_the_runner_and_its_ranks(server, api):
    job_id = api.post("/jobs", json=tiny("cancel", world=2, iters=10 ** 6)).json()["id"]
    wait_for(api, job_id, ("RUNNING",))
    pids = [p["pid"] for p in api.get(f"/jobs/{job_id}/placement").json()["ranks"]]
    runner = json.loads((server.data_dir / "jobs" / job_id / "runner.json").read_text())["pid"]
    assert all(pid_alive(p) for p in pids + [runner])
    queued = api.post("/jobs", json=tiny("waits", world=2, iters=1)).json()["id"]
    r = api.post(f"/jobs/{queued}/cancel")  # the cluster is full: it is still queued, and never starts
    assert r.status_code == 202 and r.json()["state"] == "CANCELLED"
    r = api.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 202
    job = wait_for(api, job_id, ("CANCELLED", "FAILED", "SUCCEEDED"), timeout_s=30)
    assert job["state"] == "CANCELLED" and job["error"]["code"] == "cancelled"
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids + [runner]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids + [runner])  # mutation: cancel() a no-op -> still running
    deadline = time.monotonic() + 10
    while api.get("/cluster").json()["gpus_free"] != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.get("/cluster").json()["gpus_free"] == 2  # its slots are released
    assert not (server.data_dir / "jobs" / queued / "runner.json").exists()
    assert [e["state"] for e in api.get(f"/jobs/{queued}/events").json()["events"]] == ["QUEUED", "CANCELLED"]


def test_whole_cluster_jobs_run_one_after_the_other_in_priority_order(api):
    first = api.post("/jobs", json=tiny("first", world=2, iters=2)).json()["id"]
    wait_for(api, first, ("STARTING", "RUNNING", "SUCCEEDED"))
    low = api.post("/jobs", json=tiny("low", world=2, iters=2, priority=0)).json()["id"]
    high = api.post("/jobs", json=tiny("high", world=2, iters=2, priority=5)).json()["id"]
    assert api.get(f"/jobs/{low}").json()["state"] == "QUEUED"
    jobs = {j: wait_for(api, j, ("SUCCEEDED", "FAILED"), timeout_s=180) for j in (first, high, low)}
    assert all(j["state"] == "SUCCEEDED" for j in jobs.values())
    spans = {j: (job["attempts"][0]["started_at"], job["attempts"][0]["ended_at"]) for j, job in jobs.items()}
    # each needs the whole cluster: no overlap, and the higher priority went first although submitted later
    assert spans[first][1] <= spans[high][0] and spans[high][1] <= spans[low][0]


def test_keep_best_keeps_the_lowest_val_loss_checkpoints_and_lists_them(server, api):
    """checkpoint.keep_best 2 with keep_last 1 on the serve path: what stays on disk is the last
    checkpoint and the two with the lowest val_loss of the job's own curve; the checkpoints endpoint lists
    them with their metric and why, and each commit's ``checkpoint`` event says what it kept."""
    spec = tiny("best", world=1, iters=6)
    spec["training"].update({"eval_interval": 1, "eval_iters": 1, "lr": 3e-2})
    spec["checkpoint"] = {"save_interval": 1, "keep_last": 1, "keep_best": 2}
    job_id = api.post("/jobs", json=spec).json()["id"]
    job = wait_for(api, job_id, ("SUCCEEDED", "FAILED"))
    assert job["state"] == "SUCCEEDED", job
    val = dict(zip(*(api.get(f"/jobs/{job_id}/metrics", params={"names": "val_loss"}).json()[k]
                     for k in ("iterations", "val_loss"))))
    best = sorted(val, key=val.get)[:2]
    listed = api.get(f"/jobs/{job_id}/checkpoints").json()
    assert [c["iteration"] for c in listed["checkpoints"]] == sorted({6, *best}), (val, listed)
    for c in listed["checkpoints"]:
        assert c["metrics"]["val_loss"] == pytest.approx(val[c["iteration"]], rel=1e-6)
        assert ("last" in c["kept_because"]) == (c["iteration"] == 6)
        assert ("best val_loss" in c["kept_because"]) == (c["iteration"] in best)
        assert os.path.isdir(c["location"]) and c["size_bytes"] > 0
    assert sorted(os.listdir(listed["root"])) == [f"iter_{i:07d}" for i in sorted({6, *best})]
    events = api.get(f"/jobs/{job_id}/events", params={"kind": "checkpoint"}).json()["events"]
    assert [e["data"]["iteration"] for e in events] == list(range(1, 7))
    assert [k["iteration"] for k in events[-1]["data"]["kept"]] == sorted({6, *best})
    assert "committed; kept" in events[-1]["message"]


def test_the_openapi_types_what_the_server_checks(server):
    """The document schemathesis is run against (tests/api/rest/test_api_fuzz.py): the spec typed, the bearer
    scheme, each operation's error statuses with the one error body, typed parameters."""
    doc = httpx.get(f"{server.url}/openapi.json").json()
    spec_ref = {"$ref": "#/components/schemas/JobSpec"}
    for path in ("/api/v1/jobs", "/api/v1/plan"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == spec_ref  # mutation: the untyped object again
    spec = doc["components"]["schemas"]["JobSpec"]
    assert spec["minProperties"] == 1 and spec["additionalProperties"] is False
    assert {"model", "parallel", "training", "resources"} <= set(spec["properties"])
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            errors = {c: r for c, r in op["responses"].items() if c.startswith("4")}
            assert all(r["content"]["application/json"]["schema"] == error for r in errors.values()), (path, method)
            assert ("401" in errors) == (path != "/healthz"), (path, method)
            assert ("404" in errors) == ("{job_id}" in path or "{name}" in path), (path, method)  # {name}: a user
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    params = {p["name"]: p["schema"] for p in doc["paths"]["/api/v1/jobs"]["get"]["parameters"]}
    assert doc["components"]["schemas"]["JobState"]["enum"] == list(STATES_IN_ORDER) and "$ref" in params["state"]
    events = {p["name"]: p for p in doc["paths"]["/api/v1/jobs/{job_id}/events"]["get"]["parameters"]}
    assert events["last-event-id"]["in"] == "header" and events["last-event-id"]["schema"]["type"] == "integer"
    logs = {p["name"]: p["schema"] for p in doc["paths"]["/api/v1/jobs/{job_id}/logs"]["get"]["parameters"]}
    assert logs["offset"]["type"] == "integer" and logs["offset"]["maximum"] == 2**53 - 1


STATES_IN_ORDER = ("QUEUED", "STARTING", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED")
