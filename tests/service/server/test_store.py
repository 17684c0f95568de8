"""The job store: SQLite (WAL, busy timeout) and, when the machine has one, a real PostgreSQL server.

Each test runs on both backends; the PostgreSQL runs are skipped, with the reason, when no
server binaries or no driver are installed. Writers in several threads and in two real
processes share one database.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from glob import glob

import pytest
import sqlalchemy as sa

import service.server.store as store_mod
import service.server.store_schema as schema_mod
from service.control.controller import JobEvent, JobState
from service.server.store import InvalidTransition, JobStore, SchemaError, UnknownJob, sqlite_url
from workers.rank.distributed import free_port

from tests.helpers.paths import ROOT_DIR as ROOT
from tests.helpers.store import V1_SQLITE  # noqa: F401


# -- backends ---------------------------------------------------------------------------------------

def _pg_binaries() -> tuple[str, str] | str:
    dirs = [os.path.dirname(p) for p in (shutil.which("pg_ctl"),) if p] + sorted(glob("/usr/lib/postgresql/*/bin"))
    for d in dirs:
        if os.path.exists(os.path.join(d, "initdb")) and os.path.exists(os.path.join(d, "pg_ctl")):
            return os.path.join(d, "initdb"), os.path.join(d, "pg_ctl")
    return "PostgreSQL is not installed (no initdb/pg_ctl on PATH or under /usr/lib/postgresql)"


@pytest.fixture(scope="session")
def pg_server():
    """A throwaway PostgreSQL cluster in a temp dir (run as the 'postgres' user when we are root)."""
    found = _pg_binaries()
    if isinstance(found, str):
        pytest.skip(found)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("PostgreSQL is installed but its Python driver is not: pip install 'psycopg[binary]'")
    initdb, pg_ctl = found
    user = None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, and there is no 'postgres' user to run the PostgreSQL server as")
    base = tempfile.mkdtemp(prefix="raytron-pg-")
    if user is not None:
        os.chown(base, user.pw_uid, user.pw_gid)
    port = free_port()
    run = dict(user=user.pw_uid if user else None, group=user.pw_gid if user else None, capture_output=True,
               text=True, timeout=120)
    done = subprocess.run([initdb, "-D", f"{base}/data", "-U", "raytron", "--auth=trust", "--no-sync"], **run)
    if done.returncode:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"initdb failed: {done.stderr.strip()[-300:]}")
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
    done = subprocess.run([pg_ctl, "-D", f"{base}/data", "-o", opts, "-l", f"{base}/log", "-w", "start"], **run)
    if done.returncode:
        log = open(f"{base}/log").read()[-300:] if os.path.exists(f"{base}/log") else done.stderr
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"the PostgreSQL server did not start: {log}")
    yield f"postgresql+psycopg://raytron@127.0.0.1:{port}"
    subprocess.run([pg_ctl, "-D", f"{base}/data", "-m", "immediate", "stop"], **run)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.procs)])  # a real server
def url(request, tmp_path):
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
    server = request.getfixturevalue("pg_server")
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(f"{server}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return f"{server}/{name}"


@pytest.fixture
def store(url):
    s = JobStore(url)
    yield s
    s.close()


def ev(kind: str, state: str, message: str = "", data: dict | None = None) -> dict:
    return JobEvent.now(kind, JobState(state), message, data).to_dict()


# -- jobs, events, attempts, metrics ----------------------------------------------------------------

def test_states_are_the_controllers():
    assert store_mod.STATES == tuple(s.value for s in JobState)
    assert store_mod.TERMINAL_STATES == {s.value for s in JobState if s.is_terminal}


def test_create_get_list_newest_first(store):
    a = store.create_job({"name": "a"}, sizes={"tp": 2})
    b = store.create_job({"name": "b", "priority": 5}, priority=5)
    c = store.create_job({"name": "c"}, job_id="my-job", priority=-1)
    assert (a["state"], a["priority"], a["iteration"], a["sizes"]) == ("QUEUED", 0, 0, {"tp": 2})
    assert (b["priority"], c["id"], c["priority"]) == (5, "my-job", -1)
    assert store.get_job(b["id"])["spec"] == {"name": "b", "priority": 5}
    assert store.get_job("nope") is None
    assert [j["name"] for j in store.list_jobs()] == ["c", "b", "a"]
    assert [j["name"] for j in store.list_jobs(limit=2)] == ["c", "b"]
    with pytest.raises(ValueError, match="exists already"):
        store.create_job({"name": "x"}, job_id="my-job")
    with pytest.raises(ValueError, match="limit must be at least 1, got 0"):
        store.list_jobs(limit=0)
    assert store.events(a["id"]) == [{**store.events(a["id"])[0], "seq": 1, "kind": "state", "state": "QUEUED",
                                      "message": "submitted"}]


def test_a_controllers_history_drives_the_job_row(store):
    """A run with one restart, as the controller emits it: state, attempts, metrics, error follow."""
    job = store.create_job({"name": "t"})["id"]
    history = [ev("state", "QUEUED", "8 ranks"), ev("state", "STARTING", "placing ranks"),
               ev("placement", "STARTING", "8 ranks placed", {"placement": [{"rank": 0}]}),
               ev("state", "RUNNING"), ev("iteration", "RUNNING", "", {"iteration": 1, "loss": 5.5}),
               ev("failure", "RUNNING", "rank 1 died", {"code": "rank_died", "message": "rank 1 died"}),
               ev("state", "RESTARTING", "restart 1"),
               ev("state", "STARTING", "placing ranks (attempt 2)", {"from_checkpoint": "/ckpt/iter_1"}),
               ev("state", "RUNNING"), ev("iteration", "RUNNING", "", {"iteration": 1, "loss": 5.4}),
               ev("iteration", "RUNNING", "", {"iteration": 2, "loss": 5.0})]
    for e in history:
        store.append_event(job, e)
    mid = store.get_job(job)
    assert (mid["state"], mid["iteration"], mid["error"]) == ("RUNNING", 2, None)
    store.append_event(job, ev("state", "SUCCEEDED", "2 iterations"))
    assert store.get_job(job)["state"] == "SUCCEEDED"
    assert [e["seq"] for e in store.events(job)] == list(range(1, 14))
    assert [e["kind"] for e in store.events(job, after_seq=11)] == ["iteration", "state"]
    assert store.events(job, after_seq=1)[0] == {**history[0], "seq": 2}
    assert [e["data"] for e in store.events(job, kind="placement")] == [{"placement": [{"rank": 0}]}]
    one, two = store.attempts(job)
    assert (one["number"], one["reason"], one["ended_at"]) == (1, "RESTARTING: restart 1", history[6]["time"])
    assert (two["number"], two["from_checkpoint"], two["reason"]) == (2, "/ckpt/iter_1", "SUCCEEDED: 2 iterations")
    assert store.metrics(job) == [{"iteration": 1, "loss": 5.4}, {"iteration": 2, "loss": 5.0}]
    assert store.metrics(job, after_iteration=1) == [{"iteration": 2, "loss": 5.0}]


def test_failed_and_cancelled_record_the_error(store):
    failed = store.create_job({"name": "f"})["id"]
    store.append_event(failed, ev("failure", "RUNNING", "boom", {"code": "rank_raised", "message": "boom", "rank": 3}))
    store.append_event(failed, ev("state", "FAILED", "boom"))
    assert store.get_job(failed)["error"] == {"code": "rank_raised", "message": "boom", "rank": 3}
    queued = store.create_job({"name": "q"})["id"]
    job = store.update_job(queued, state="CANCELLED", message="user asked")
    assert (job["state"], job["error"]) == ("CANCELLED", {"code": "cancelled", "message": "user asked"})
    assert store.events(queued)[-1]["data"] == {"from": "QUEUED"}


def test_no_transition_out_of_a_terminal_state(store):
    job = store.create_job({"name": "t"})["id"]
    store.update_job(job, state="SUCCEEDED", ray_job_id="raysubmit_1", sizes={"dp": 2})
    n = len(store.events(job))
    for state in ("RUNNING", "FAILED", "SUCCEEDED"):
        with pytest.raises(InvalidTransition, match=f"is SUCCEEDED, which is final; it cannot become {state}"):
            store.update_job(job, state=state)
        with pytest.raises(InvalidTransition):
            store.append_event(job, ev("state", state))
    row = store.get_job(job)
    assert (row["state"], row["ray_job_id"], row["sizes"], len(store.events(job))) == ("SUCCEEDED", "raysubmit_1",
                                                                                       {"dp": 2}, n)
    store.append_event(job, ev("iteration", "SUCCEEDED", "late log line"))  # not a transition: kept
    with pytest.raises(ValueError, match="among QUEUED"):
        store.append_event(job, {"time": 1.0, "kind": "state", "state": "DONE"})


def test_append_event_is_idempotent_by_seq(store):
    job = store.create_job({"name": "t"})["id"]
    base = store.last_seq(job)
    first, second = ev("state", "STARTING"), ev("state", "RUNNING")
    assert store.append_event(job, first, seq=base + 1) == base + 1
    assert store.append_event(job, second, seq=base + 2) == base + 2
    assert store.append_event(job, first, seq=base + 1) == base + 1  # replayed after a restart: stored once
    assert [e["kind"] for e in store.events(job)] == ["state"] * 3 and store.last_seq(job) == base + 2
    assert len(store.attempts(job)) == 1
    with pytest.raises(ValueError, match=f"event {base + 1} of job {job} is already"):
        store.append_event(job, ev("iteration", "RUNNING", "", {"iteration": 1}), seq=base + 1)


def test_unknown_jobs(store):
    for call in (lambda: store.append_event("nope", ev("state", "RUNNING")), lambda: store.events("nope"),
                 lambda: store.update_job("nope", state="CANCELLED"), lambda: store.last_seq("nope")):
        with pytest.raises(UnknownJob, match="no job 'nope'"):
            call()


def test_jobs_in_states_in_submission_order(store):
    ids = [store.create_job({"name": f"j{i}"})["id"] for i in range(4)]
    store.update_job(ids[1], state="STARTING")
    store.update_job(ids[2], state="CANCELLED")
    assert [j["id"] for j in store.jobs_in_states("QUEUED")] == [ids[0], ids[3]]
    assert [j["id"] for j in store.jobs_in_states("QUEUED", "STARTING")] == [ids[0], ids[1], ids[3]]
    assert [j["id"] for j in store.list_jobs(states=("CANCELLED",))] == [ids[2]]
    with pytest.raises(ValueError, match="unknown job state"):
        store.jobs_in_states("DONE")


def test_attempts_and_metrics_follow_the_events(store):
    """Attempts and metrics are written by the events, as the job runner writes them: a STARTING
    opens an attempt (with the checkpoint it starts from), a RESTARTING closes it with its reason,
    and an iteration recorded again (after a restart from a checkpoint) replaces the first."""
    job = store.create_job({"name": "t"})["id"]
    store.append_event(job, {"time": 10.0, "kind": "state", "state": "STARTING", "message": "",
                             "data": {"from": "QUEUED", "from_checkpoint": "/c/iter_5"}})
    a = store.attempts(job)[-1]
    assert (a["started_at"], a["ended_at"], a["from_checkpoint"]) == (10.0, None, "/c/iter_5")
    store.append_event(job, {"time": 12.0, "kind": "state", "state": "RESTARTING", "message": "node lost",
                             "data": {"from": "RUNNING"}})
    a = store.attempts(job)[-1]
    assert (a["started_at"], a["ended_at"], a["reason"], a["from_checkpoint"]) == (
        10.0, 12.0, "RESTARTING: node lost", "/c/iter_5")
    assert [x["number"] for x in store.attempts(job)] == [1]
    store.append_event(job, ev("iteration", "RUNNING", "", {"iteration": 3, "loss": 2.0}))
    store.append_event(job, ev("iteration", "RUNNING", "", {"iteration": 3, "loss": 1.5, "tokens_per_s": 9.0}))
    assert store.metrics(job) == [{"iteration": 3, "loss": 1.5, "tokens_per_s": 9.0}]


# -- schema ---------------------------------------------------------------------------------------

def _set_version(url: str, version: int) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(schema_mod.schema_version.update().values(version=version))
    engine.dispose()


def test_a_newer_schema_is_refused_with_the_fix(url):
    JobStore(url).close()
    _set_version(url, 99)
    with pytest.raises(SchemaError, match=rf"schema version 99, newer than {schema_mod.SCHEMA_VERSION}.*Upgrade raytron.*--database-url"):
        JobStore(url)


def test_an_older_schema_is_migrated_once(url, monkeypatch):
    s = JobStore(url)
    s.create_job({"name": "old"})
    s.close()
    calls = []

    def add_note(conn):
        calls.append(1)
        conn.execute(sa.text("ALTER TABLE jobs ADD COLUMN note VARCHAR(64)"))

    v = schema_mod.SCHEMA_VERSION
    monkeypatch.setattr(schema_mod, "SCHEMA_VERSION", v + 1)
    monkeypatch.setattr(schema_mod, "MIGRATIONS", {v: add_note})
    s = JobStore(url)
    s.close()
    JobStore(url).close()
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(schema_mod.schema_version.select()).scalar_one() == v + 1
        assert conn.execute(sa.text("SELECT name, note FROM jobs")).all() == [("old", None)]
    engine.dispose()
    assert calls == [1]
    monkeypatch.setattr(schema_mod, "SCHEMA_VERSION", v + 2)
    with pytest.raises(SchemaError, match=f"no migration leads from {v + 1} to {v + 2}"):
        JobStore(url)


# The tables of schema version 1, as SQLAlchemy created them on SQLite (raytron before the v2 aggregates).


def test_a_v1_database_gets_the_v2_aggregates_from_its_rows(tmp_path):
    """A database of schema v1 (no aggregate columns) is migrated: the job's latest loss and its
    metric names are filled from its rows (the current iteration's, not a later stale row's)."""
    path = tmp_path / "raytron.db"
    with sqlite3.connect(path) as db:
        db.executescript(V1_SQLITE)
    s = JobStore(f"sqlite:///{path}")
    try:
        job = s.get_job("old-1")
        assert (job["loss"], job["tokens_per_s"], job["last_seq"]) == (4.0, None, 3)
        assert job["metric_names"] == ["loss", "lr", "tokens_per_s"]  # mutation: names not backfilled -> None
        assert [r[:2] for r in s.metric_rows("old-1")] == [(1, None), (2, None), (3, None)]
        s.append_event("old-1", ev("iteration", "RUNNING", "", {"iteration": 3, "loss": 2.5}))
        assert (s.get_job("old-1")["loss"], s.get_job("old-1")["last_seq"]) == (2.5, 4)
    finally:
        s.close()


def test_the_job_row_carries_its_latest_metrics_and_names(store):
    """Reading a job reads no metrics row: its latest loss, tokens/s, metric names and last seq are
    columns, written with each event; each metrics row knows the attempt that wrote it."""
    job = store.create_job({"name": "agg"})["id"]
    assert (store.get_job(job)["last_seq"], store.get_job(job)["loss"]) == (1, None)
    store.append_event(job, ev("state", "STARTING", "", {"from": "QUEUED"}))
    for i in (1, 2, 3):
        store.append_event(job, ev("iteration", "RUNNING", "", {"iteration": i, "loss": 6.0 - i, "tokens_per_s": 10.0 * i}))
    row = store.get_job(job)
    assert (row["iteration"], row["loss"], row["tokens_per_s"], row["last_seq"]) == (3, 3.0, 30.0, 5)
    assert row["metric_names"] == ["loss", "tokens_per_s"]
    store.append_event(job, ev("state", "RESTARTING", "rank lost", {"from": "RUNNING"}))
    store.append_event(job, ev("state", "STARTING", "", {"from": "RESTARTING"}))
    store.append_event(job, ev("iteration", "RUNNING", "", {"iteration": 2, "loss": 4.5, "grad_norm": 1.0}))
    row = store.get_job(job)
    # after a restart from a checkpoint: the iteration run again, not the earlier attempt's further one
    assert (row["iteration"], row["loss"], row["tokens_per_s"]) == (2, 4.5, None)  # mutation: loss kept -> 3.0
    assert row["metric_names"] == ["grad_norm", "loss", "tokens_per_s"]
    assert [r[:2] for r in store.metric_rows(job)] == [(1, 1), (2, 2), (3, 1)]  # mutation: attempt not stored
    assert [r[0] for r in store.metric_rows(job, after_iteration=1, limit=1)] == [2]
    assert store.job_version(job) == (row["last_seq"], row["updated_at"]) and store.job_version("nope") is None


def test_change_token_moves_with_every_commit_from_anywhere(store, url):
    """The cache's cheap check: any commit, from this store or another one on the same database, changes it."""
    if store.dialect != "sqlite":
        assert store.change_token() is None
        return
    job = store.create_job({"name": "tok"})["id"]
    before = store.change_token()
    assert store.change_token() == before  # reads do not move it
    store.append_event(job, ev("iteration", "RUNNING", "", {"iteration": 1, "loss": 1.0}))
    after_own = store.change_token()
    assert after_own != before
    other = JobStore(url)
    try:
        other.update_job(job, ray_job_id="r-1")
    finally:
        other.close()
    assert store.change_token() != after_own  # mutation: a constant token -> equal


def test_list_jobs_pages_by_number_and_filters_by_name(store):
    ids = [store.create_job({"name": "a" if i % 2 else "b"})["id"] for i in range(5)]
    first = store.list_jobs(limit=2)
    assert [j["id"] for j in first] == ids[:-3:-1]
    second = store.list_jobs(limit=2, before=first[-1]["number"])
    assert [j["id"] for j in second] == [ids[2], ids[1]]
    assert [j["id"] for j in store.list_jobs(name="a")] == [ids[3], ids[1]]


@pytest.mark.procs
def test_store_imports_no_controller_api_or_workers():
    code = ("import sys, service.server.store; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('api', 'workers', 'torch', 'ray') or m == 'service.control.controller'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- SQLite specifics ----------------------------------------------------------------------------

def test_sqlite_is_wal_and_waits_for_a_busy_writer(tmp_path):
    url = sqlite_url(tmp_path)
    with pytest.raises(ValueError, match="in-memory"):
        JobStore("sqlite://")
    store, impatient = JobStore(url), JobStore(url, busy_timeout_s=0.05)
    job = store.create_job({"name": "t"})["id"]
    assert sqlite3.connect(tmp_path / "raytron.db").execute("PRAGMA journal_mode").fetchone() == ("wal",)
    other = sqlite3.connect(tmp_path / "raytron.db", isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with pytest.raises(sa.exc.OperationalError, match="locked"):
        impatient.append_event(job, ev("state", "STARTING"))
    assert store.get_job(job)["state"] == "QUEUED"  # WAL: a reader does not wait for the writer
    threading.Timer(0.5, other.execute, ("COMMIT",)).start()  # ... for 0.5 s more, however loaded the machine
    t0 = time.perf_counter()
    store.append_event(job, ev("state", "STARTING"))
    assert time.perf_counter() - t0 > 0.2 and store.get_job(job)["state"] == "STARTING"


# -- concurrency ----------------------------------------------------------------------------------

def test_threads_share_one_store(store):
    job = store.create_job({"name": "t"})["id"]
    errors = []

    def work(i):
        try:
            for k in range(15):
                store.append_event(job, ev("iteration", "QUEUED", f"t{i}-{k}"))
            store.create_job({"name": f"thread{i}"})
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = store.events(job)
    assert [e["seq"] for e in got] == list(range(1, 1 + 1 + 8 * 15))
    assert sorted(e["message"] for e in got[1:]) == sorted(f"t{i}-{k}" for i in range(8) for k in range(15))
    assert len(store.list_jobs()) == 9


WRITER = """
import os, sys, time
from service.server.store import JobStore
url, job, tag, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
store = JobStore(url)
while not os.path.exists(sys.argv[5]):
    time.sleep(0.005)
for k in range(n):
    store.append_event(job, {"time": time.time(), "kind": "iteration", "state": "QUEUED",
                             "message": f"{tag}-{k}", "data": {"iteration": k}})
    if k % 10 == 0:
        store.create_job({"name": tag})
print("ok")
"""


@pytest.mark.procs
def test_two_processes_write_one_database(url, tmp_path):
    """A controller process and a server process append to the same job at the same time."""
    store = JobStore(url)
    job = store.create_job({"name": "shared"})["id"]
    go, n = tmp_path / "go", 60
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, url, job, tag, str(n), str(go)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tag in ("ctrl", "srv")]
    time.sleep(0.5)
    go.touch()
    seen = 0
    while any(p.poll() is None for p in procs):  # reads meanwhile only ever see whole, growing histories
        now = [e["seq"] for e in store.events(job)]
        assert now == list(range(1, len(now) + 1)) and len(now) >= seen
        seen = len(now)
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    got = store.events(job)
    assert [e["seq"] for e in got] == list(range(1, 2 + 2 * n))
    assert sorted(e["message"] for e in got[1:]) == sorted(f"{t}-{k}" for t in ("ctrl", "srv") for k in range(n))
    assert len(store.list_jobs(limit=1000)) == 1 + 2 * (n // 10)
    store.close()
