"""A service for a team (issue 22): users and tokens, owned jobs, GPU quotas in the gang queue, the
audit trail and the limits on submissions.

The parts on their own (the accounts over a real SQLite store, a v1 database migrated, admission
with quotas, the rate limiter on a fake clock), then the acceptance scenario end to end: a real
``raytron serve --launcher processes --simulate 2x4`` with an admin and two users of GPU quotas 8
and 4 (the quotas are the scheduler's, whatever the launcher).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api.rest.limits import RateLimiter
from service.server.accounts import Accounts, load_or_create_secret
from service.server.queue import QueuedJob, admit
from service.server.store import JobStore, sqlite_url
from tests.helpers.paths import ROOT
from tests.helpers.server import TOKEN, Server, tiny, wait_for


def _db_bytes(data_dir: Path) -> bytes:
    """Every byte of the SQLite database, its WAL included (a fresh write may be only there)."""
    return b"".join(p.read_bytes() for p in sorted(data_dir.glob("raytron.db*")))


@pytest.fixture
def accounts(tmp_path):
    store = JobStore(sqlite_url(tmp_path))
    yield Accounts(store, load_or_create_secret(tmp_path), "the-bootstrap-token")
    store.close()


# ---- the parts -------------------------------------------------------------------------------------

def test_tokens_are_random_shown_once_and_stored_as_digests(accounts, tmp_path):
    user, token = accounts.add_user("alice", gpu_quota=8)
    second = accounts.new_token("alice")
    assert token != second and len(token) >= 43  # 32 random bytes, urlsafe base64
    assert accounts.authenticate(token) == user and accounts.authenticate(second) == user  # the old one works on
    assert accounts.authenticate(token + "x") is None and accounts.authenticate("") is None
    assert accounts.authenticate("the-bootstrap-token").admin
    data = _db_bytes(tmp_path)
    for t in (token, second):
        assert t.encode() not in data  # mutation: store the token itself -> found
        assert accounts.digest(t).encode() in data
    assert (tmp_path / "token_secret").stat().st_mode & 0o777 == 0o600
    # another server secret: the same token has another digest (a copy of the database alone proves nothing)
    other = Accounts(accounts.store, b"another secret", "the-bootstrap-token")
    assert other.authenticate(token) is None


def test_a_revoked_or_removed_users_tokens_are_refused_at_once(accounts):
    _, token = accounts.add_user("bob", gpu_quota=4)
    assert accounts.authenticate(token).name == "bob"  # cached from here on
    assert accounts.revoke("bob") == 1
    assert accounts.authenticate(token) is None  # mutation: no cache drop on revoke -> still bob
    token = accounts.new_token("bob")
    assert accounts.authenticate(token).name == "bob"
    accounts.remove("bob")
    assert accounts.authenticate(token) is None and accounts.user("bob") is None
    with pytest.raises(ValueError, match="bootstrap admin"):
        accounts.remove("admin")


def test_a_v1_database_is_migrated_and_its_jobs_belong_to_the_bootstrap_admin(tmp_path):
    from tests.helpers.store import V1_SQLITE

    with sqlite3.connect(tmp_path / "raytron.db") as db:
        db.executescript(V1_SQLITE)
    store = JobStore(sqlite_url(tmp_path))
    try:
        assert store.get_job("old-1")["owner"] == "admin"  # mutation: no v3 migration -> SchemaError
        assert [j["id"] for j in store.list_jobs(owner="admin")] == ["old-1"]
        assert store.list_jobs(owner="alice") == []
        accounts = Accounts(store, b"k" * 32, "boot")
        assert [u["name"] for u in accounts.list_users()] == ["admin"]
        assert accounts.owner_of("old-1") == "admin"
    finally:
        store.close()


def _job(id: str, t: float, owner: str, nodes: int = 1, gpus: int = 4, priority: int = 0) -> QueuedJob:
    return QueuedJob(id=id, submitted_at=t, num_nodes=nodes, gpus_per_node=gpus, priority=priority, owner=owner)


def test_a_job_over_its_owners_quota_waits_without_blocking_the_queue():
    queued = [_job("a-big", 1, "alice", nodes=2), _job("b-small", 2, "bob", gpus=2), _job("a-small", 3, "alice")]
    plan = admit([4, 4], queued, quotas={"alice": 8, "bob": 4}, held={"alice": 4})
    # a-big (8 more for alice, who holds 4 of 8) waits, and does not hold up the two behind it
    assert [a.job.id for a in plan.start] == ["b-small", "a-small"]  # mutation: over-quota job as head -> []
    assert [(j.id, held) for j, _, held in plan.over_quota] == [("a-big", 4)]
    assert "alice's running jobs hold 4 of 8 GPU slots and this job needs 8" in plan.over_quota[0][1]
    assert plan.over_quota[0][:2] in plan.waiting
    # each start counts against its owner within one pass
    plan = admit([4, 4], [_job("x", 1, "carol"), _job("y", 2, "carol")], quotas={"carol": 4})
    assert [a.job.id for a in plan.start] == ["x"] and [(j.id, h) for j, _, h in plan.over_quota] == [("y", 4)]
    plan = admit([4, 4], [_job("x", 1, "carol"), _job("y", 2, "carol")], quotas={"carol": None})
    assert [a.job.id for a in plan.start] == ["x", "y"]


def test_the_rate_limiter_allows_a_burst_then_the_rate():
    now = [0.0]
    limiter = RateLimiter(per_minute=6, burst=2, clock=lambda: now[0])
    assert limiter.take("u") is None and limiter.take("u") is None
    assert limiter.take("u") == pytest.approx(10.0)  # 6 a minute: one every 10 s
    assert limiter.take("v") is None  # per user
    now[0] = 10.0
    assert limiter.take("u") is None and limiter.take("u") is not None


def test_the_scheduler_holds_each_owner_to_its_quota_across_a_restart(tmp_path):
    """Stepped one pass at a time (tests/service/server/test_scheduler.py's fake runners, a real store): u's second
    job waits on u's quota of 2 while v's runs; a restarted scheduler counts the job it re-attaches
    to; the waiting job starts once u's first one ends."""
    from service.server.scheduler import Scheduler, StaticCluster
    from tests.helpers.scheduler import FakeRunners, finish, spec

    store = JobStore(sqlite_url(tmp_path))
    try:
        runners, quotas = FakeRunners(), {"u": 2}
        sched = Scheduler(store, runners, StaticCluster(3, 2), vanish_grace_s=0.0, quota_of=quotas.get)
        j1, j2 = (sched.submit(spec(n), owner="u")["id"] for n in ("j1", "j2"))
        j3 = sched.submit(spec("j3"), owner="v")["id"]
        sched.step()
        sched.step()
        assert runners.launched == [j1, j3]  # mutation: no quota in admit -> j2 takes j3's place
        waits = store.events(j2, kind="waiting")
        assert len(waits) == 1 and waits[0]["data"] == {"reason": "gpu_quota", "quota": 2, "held": 2, "needed": 2}
        runners.known = {j1, j3}
        again = Scheduler(store, runners, StaticCluster(3, 2), vanish_grace_s=0.0, quota_of=quotas.get)
        again.recover()
        again.step()
        assert runners.launched == [j1, j3]  # a node is free: mutation: a re-attached job not counted -> j2 starts
        finish(store, runners, j1)
        again.step()
        again.step()
        assert runners.launched == [j1, j3, j2]
    finally:
        store.close()


# ---- the acceptance scenario, end to end ---------------------------------------------------------

def _wide(name: str, nodes: int, iters: int = 10 ** 7, **kw) -> dict:
    spec = tiny(name, world=4, iters=iters, **kw)
    spec["resources"] = {"num_nodes": nodes, "gpus_per_node": 4}
    spec["training"]["global_batch_size"] = 8  # data parallel over 4 or 8 ranks
    return spec


def _cli(srv: Server, token: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAYTRON_API_TOKEN": token, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "api.cli.main", *args, "--server", srv.url], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def _job_routes(srv: Server) -> list[tuple[str, str]]:
    """Every (method, path) of the API with a job id in it, from the server's own document: a route
    added later is covered without a change here."""
    doc = httpx.get(f"{srv.url}/openapi.json").json()
    return [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if "{job_id}" in p]


@pytest.mark.procs
def test_three_users_on_a_2x4_cluster(tmp_path):
    srv = Server(tmp_path / "d", simulate="2x4", extra_args=("--submit-burst", "3", "--max-submits-per-minute", "1",
                                                             "--max-queued-per-user", "1")).start()
    runners: list[int] = []
    try:
        admin = srv.client()
        # users: the REST API and the CLI
        r = admin.post("/users", json={"name": "alice", "gpu_quota": 8})
        assert r.status_code == 201 and set(r.json()) == {"name", "token"}
        alice_token = r.json()["token"]
        cli = _cli(srv, TOKEN, "users", "add", "bob", "--gpu-quota", "4", "--json")
        assert cli.returncode == 0, cli.stderr
        bob_token = json.loads(cli.stdout)["token"]
        carol_token = admin.post("/users", json={"name": "carol"}).json()["token"]
        cli = _cli(srv, TOKEN, "users", "token", "alice", "--json")  # a second token of alice's
        assert cli.returncode == 0, cli.stderr
        spare = json.loads(cli.stdout)["token"]
        cli = _cli(srv, TOKEN, "users", "list", "--json")
        assert {u["name"] for u in json.loads(cli.stdout)} == {"admin", "alice", "bob", "carol"}, cli.stderr
        assert admin.post("/users", json={"name": "alice"}).status_code == 409
        alice, bob, carol = srv.client(alice_token), srv.client(bob_token), srv.client(carol_token)
        assert alice.get("/me").json() == {"name": "alice", "admin": False, "gpu_quota": 8, "max_priority": None}
        assert bob.get("/users").status_code == 403 and bob.get("/audit").status_code == 403

        # alice: a 4-GPU job runs (held: its runner stopped), then her 8-GPU job waits on her quota
        a1 = alice.post("/jobs", json=_wide("a1", 1)).json()["id"]
        wait_for(alice, a1, ("STARTING", "RUNNING"))
        runners.append(json.loads((srv.data_dir / "jobs" / a1 / "runner.json").read_text())["pid"])
        os.killpg(runners[-1], signal.SIGSTOP)  # it holds its slots without taking a core
        a2 = alice.post("/jobs", json=_wide("a2", 2)).json()["id"]
        waits = []
        for _ in range(100):
            waits = alice.get(f"/jobs/{a2}/events", params={"kind": "waiting"}).json()["events"]
            if waits:
                break
            time.sleep(0.1)
        assert waits and waits[0]["data"] == {"reason": "gpu_quota", "quota": 8, "held": 4, "needed": 8}, waits
        assert "quota" in waits[0]["message"] and alice.get(f"/jobs/{a2}").json()["state"] == "QUEUED"
        r = alice.post("/jobs", json=tiny("a3", world=1))
        assert r.status_code == 429 and r.json()["code"] == "too_many_queued" and r.headers["retry-after"]

        # bob: the 8-GPU job is larger than his quota: refused with needed vs quota
        r = bob.post("/jobs", json=_wide("b-big", 2))
        assert r.status_code == 422 and r.json()["code"] == "over_quota"
        assert (r.json()["needed"], r.json()["quota"]) == (8, 4) and "8 GPU slots" in r.json()["message"]
        r = bob.post("/jobs", json=tiny("b-prio", world=1, priority=5))
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "priority" and "cap of 0" in r.json()["message"]
        b1 = bob.post("/jobs", json=tiny("b1", world=1, iters=2)).json()["id"]  # fits: it passes alice's waiting job
        assert wait_for(bob, b1, ("SUCCEEDED", "FAILED"))["state"] == "SUCCEEDED"
        # many scheduler passes later: the reason was recorded once (mutation: an event per pass)
        assert len(alice.get(f"/jobs/{a2}/events", params={"kind": "waiting"}).json()["events"]) == 1

        # each user sees only their own jobs; the admin sees all, with the owner
        assert {j["id"] for j in alice.get("/jobs").json()["jobs"]} == {a1, a2}
        assert {j["id"] for j in alice.get("/jobs", params={"owner": "bob"}).json()["jobs"]} == {a1, a2}
        assert {j["id"] for j in bob.get("/jobs").json()["jobs"]} == {b1}
        assert {(j["id"], j["owner"]) for j in admin.get("/jobs").json()["jobs"]} == {
            (a1, "alice"), (a2, "alice"), (b1, "bob")}
        assert "a1" not in bob.get(f"{srv.url}/metrics").text.replace(b1, "")  # the Prometheus page: his jobs only

        # another user's job is a 404 on every route (the same answer as no job), cancel included
        routes = _job_routes(srv)
        assert {("GET", "/api/v1/jobs/{job_id}"), ("POST", "/api/v1/jobs/{job_id}/cancel"),
                ("GET", "/api/v1/jobs/{job_id}/events"), ("GET", "/api/v1/jobs/{job_id}/logs")} <= set(routes)
        for method, path in routes:
            for headers, params in (({}, {}), ({"Accept": "text/event-stream"}, {"follow": "true"})):
                url = srv.url + path.replace("{job_id}", a1)
                r = bob.request(method, url, headers=headers, params=params)
                assert r.status_code == 404 and r.json()["code"] == "job_not_found", (method, path, r.text)
                nothing = bob.request(method, srv.url + path.replace("{job_id}", "no-such-job"), headers=headers,
                                      params=params)
                assert r.json()["message"].replace(a1, "X") == nothing.json()["message"].replace("no-such-job", "X")
            if method == "GET":  # the owner and the admin read it
                assert alice.get(srv.url + path.replace("{job_id}", a1)).status_code == 200, path
                assert admin.get(srv.url + path.replace("{job_id}", a1)).status_code == 200, path
        assert alice.get(f"/jobs/{a1}").json()["state"] in ("STARTING", "RUNNING")  # bob's cancel did nothing

        # carol floods: 429 with Retry-After past the burst (the body is not even read)
        codes = [carol.post("/jobs", json={}).status_code for _ in range(4)]
        assert codes[:3] == [422] * 3 and codes[3] == 429
        r = carol.post("/jobs", json={})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1 and r.json()["code"] == "rate_limited"

        # alice cancels her own jobs
        assert alice.post(f"/jobs/{a2}/cancel").status_code == 202
        assert alice.post(f"/jobs/{a1}/cancel").status_code == 202

        # a revoked token is refused at once; the user's other token too; a new one works
        cli = _cli(srv, TOKEN, "users", "revoke", "bob", "--json")
        assert json.loads(cli.stdout) == {"name": "bob", "revoked": 1}, cli.stderr
        assert bob.get("/jobs").status_code == 401  # mutation: no cache drop on revoke -> 200
        listed = {u["name"]: u for u in admin.get("/users").json()["users"]}
        assert (listed["alice"]["tokens"], listed["bob"]["tokens"], listed["admin"]["admin"]) == (2, 0, True)
        assert srv.client(spare).get("/jobs").status_code == 200
        assert _cli(srv, TOKEN, "users", "remove", "carol").returncode == 0
        assert carol.get("/jobs").status_code == 401 and admin.delete("/users/carol").status_code == 404

        # the audit trail lists every action above with its user (REST and CLI)
        entries = admin.get("/audit", params={"limit": 1000}).json()["entries"]
        seen = {(e["user"], e["action"], e["target"], e["status"]) for e in entries}
        expected = {("admin", "users.add", "alice", 201), ("admin", "users.add", "bob", 201),
                    ("admin", "users.token", "alice", 201), ("admin", "users.add", "alice", 409),
                    ("alice", "submit", a1, 201), ("alice", "submit", a2, 201), ("alice", "submit", None, 429),
                    ("bob", "submit", None, 422), ("bob", "submit", b1, 201), ("bob", "cancel", a1, 404),
                    ("carol", "submit", None, 429), ("alice", "cancel", a2, 202), ("alice", "cancel", a1, 202),
                    ("admin", "users.revoke", "bob", 200), ("admin", "users.remove", "carol", 204),
                    (None, "auth", "GET /api/v1/jobs", 401)}
        assert expected <= seen, expected - seen  # mutation: no record on a refused submit -> missing
        over = [e for e in entries if e["user"] == "bob" and e["action"] == "submit" and e["status"] == 422]
        assert any(e["detail"]["code"] == "over_quota" for e in over)
        cli = _cli(srv, TOKEN, "audit", "--user", "bob", "--json")
        assert cli.returncode == 0 and {e["user"] for e in json.loads(cli.stdout)} == {"bob"}, cli.stderr
        assert _cli(srv, alice_token, "audit").returncode == 2  # not an admin: 403

        # tokens at rest and in every answer and log: nowhere but in the answer that created them
        answers = admin.get("/users").text + admin.get("/audit").text + alice.get("/me").text
        srv.stop()
        stored = _db_bytes(srv.data_dir) + srv.log.read_bytes() + answers.encode()
        assert "Traceback" not in srv.log.read_text()
        for token in (alice_token, bob_token, carol_token, spare, TOKEN):
            assert token.encode() not in stored  # mutation: the token in the audit detail -> found
    finally:
        for pid in runners:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
        srv.stop()
        srv.kill_runners()


@pytest.mark.parametrize("flag, value", [("--submit-burst", "0"), ("--max-queued-per-user", "-1"),
                                         ("--max-submits-per-minute", "x")])
@pytest.mark.procs
def test_bad_limits_are_refused_before_the_server_starts(tmp_path, flag, value):
    p = subprocess.run([sys.executable, "-m", "api.cli.main", "serve", "--data-dir", str(tmp_path), flag, value],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and flag in p.stderr and "expected a positive number" in p.stderr, p.stderr
    assert not (tmp_path / "raytron.db").exists()


def test_a_job_id_with_two_dots_has_a_log_and_no_id_leaves_the_jobs_folder(tmp_path):
    """schemathesis found it (GET /jobs/i..B-.../logs was a 500): the spec allows the name ``i..B``."""
    from service.server.logs import job_dir

    assert job_dir(tmp_path, "i..B-b95050ee") == tmp_path / "jobs" / "i..B-b95050ee"
    for bad in ("..", ".", "../x", "a/../../b", "/etc", ""):
        with pytest.raises(ValueError, match="not a valid job id"):
            job_dir(tmp_path, bad)
