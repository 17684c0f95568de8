"""The server loop, stepped one pass at a time against a fake launcher and a real SQLite store."""

from __future__ import annotations

import time

import pytest

from service.server.scheduler import NeverFits, Scheduler, StaticCluster
from service.spec.spec import parse_spec
from service.server.store import JobStore, sqlite_url
from tests.helpers.scheduler import FakeRunners, finish, spec  # noqa: F401


@pytest.fixture
def env(tmp_path):
    store = JobStore(sqlite_url(tmp_path))
    launcher = FakeRunners()
    sched = Scheduler(store, launcher, StaticCluster(2, 2), vanish_grace_s=0.0)
    yield store, launcher, sched
    store.close()


def test_whole_cluster_jobs_run_one_after_the_other(env):
    store, launcher, sched = env
    a = sched.submit(spec("a", nodes=2))["id"]
    b = sched.submit(spec("b", nodes=2))["id"]
    sched.step()
    assert launcher.launched == [a]  # mutation: admit against total instead of free slots -> both launched
    assert sched.used_slots() == {"node-0": 2, "node-1": 2} and sched.queue_length() == 1
    sched.step()
    assert launcher.launched == [a]
    finish(store, launcher, a)
    sched.step()  # releases a's slots
    sched.step()
    assert launcher.launched == [a, b]
    assert store.get_job(b)["state"] == "QUEUED"  # the runner, not the scheduler, records STARTING


def test_priority_order(env):
    store, launcher, sched = env
    blocker = sched.submit(spec("blocker", nodes=2))["id"]
    sched.step()
    low = sched.submit(spec("low", nodes=2))["id"]
    high = sched.submit(spec("high", nodes=2, priority=5))["id"]
    finish(store, launcher, blocker)
    sched.step(); sched.step()
    assert launcher.launched == [blocker, high]  # mutation: priority not passed to the queue -> low first
    finish(store, launcher, high)
    sched.step(); sched.step()
    assert launcher.launched == [blocker, high, low]


def test_never_fits_is_refused_at_submission(env):
    _, launcher, sched = env
    with pytest.raises(NeverFits, match=r"needs 3 node\(s\) x 2 GPU slots = 6 GPU slots.*2 node\(s\) x 2 GPU slots"):
        sched.submit(spec("big", nodes=3))
    with pytest.raises(NeverFits, match="gpus_per_node"):
        sched.submit(spec("wide", nodes=1, gpus=4))


def test_hot_spares_hold_nodes_of_their_own(env):
    """resources.spare_nodes: the spares' nodes count at submission (a job whose nodes and spares
    exceed the cluster is refused, naming spare_nodes) and at admission (they hold slots)."""
    store, launcher, sched = env
    with_spare = spec("spared", nodes=2).model_copy(deep=True)
    with_spare.resources.spare_nodes = 1
    with pytest.raises(NeverFits, match=r"needs 3 node\(s\).*spare_nodes 1: lower spare_nodes"):
        sched.submit(with_spare)  # mutation: spares not counted -> accepted on 2 nodes
    one = spec("one", nodes=1).model_copy(deep=True)
    one.resources.spare_nodes = 1
    a = sched.submit(one)["id"]
    b = sched.submit(spec("b", nodes=1))["id"]
    sched.step()
    assert launcher.launched == [a]  # the spare holds the second node: b waits
    finish(store, launcher, a)
    sched.step(); sched.step()
    assert launcher.launched == [a, b]


def test_a_runner_that_exits_without_a_final_state_is_started_again_until_its_restarts_are_spent(env):
    """A runner gone while its job runs gets a successor (on the slots the job holds), which goes
    on from the job's record; each one counts under fault_tolerance.max_restarts (3 here), so a
    runner that keeps dying ends the job FAILED. Fails if the scheduler fails the job at once, or
    starts runners without end."""
    store, launcher, sched = env
    a = sched.submit(spec("a"))["id"]
    sched.step()
    store.update_job(a, state="STARTING")
    for n in range(1, 4):
        launcher.alive.discard(a)  # crashed (killed, lost with its node)
        sched.step()
        assert launcher.launched == [a] * (n + 1) and store.get_job(a)["state"] == "STARTING"
        assert sched.used_slots() == {"node-0": 2}  # its slots stay held for the new runner
    runners = store.events(a, kind="runner")
    assert [e["data"]["reason"] for e in runners] == ["runner_exited"] * 3
    assert "starting runner 2" in runners[0]["message"] and "starting runner 4" in runners[2]["message"]
    launcher.alive.discard(a)
    sched.step()
    job = store.get_job(a)
    assert job["state"] == "FAILED" and job["error"]["code"] == "runner_exited"
    assert "max_restarts (3) are spent" in job["error"]["message"] and launcher.launched == [a] * 4
    assert sched.used_slots() == {}


def test_restarts_the_runners_recorded_count_toward_the_limit(env):
    """A job whose runners recorded restarts of their own (rank failures) has fewer left for a lost runner."""
    store, launcher, sched = env
    a = sched.submit(spec("a"))["id"]
    sched.step()
    for state in ("STARTING", "RUNNING", "RESTARTING", "STARTING", "RUNNING", "RESTARTING", "STARTING"):
        store.append_event(a, {"time": time.time(), "kind": "state", "state": state, "message": "", "data": {}})
    store.append_event(a, {"time": time.time(), "kind": "state", "state": "RESTARTING", "message": "grow",
                           "data": {"resize": True}})  # a resize is no restart
    launcher.alive.discard(a)
    sched.step()
    assert launcher.launched == [a, a]  # 2 restarts of 3: one runner more
    store.append_event(a, {"time": time.time(), "kind": "state", "state": "RESTARTING",
                           "message": "the controller was restarted", "data": {}})  # as the new runner replays
    launcher.alive.discard(a)
    sched.step()
    assert store.get_job(a)["state"] == "FAILED" and launcher.launched == [a, a]


def test_cancel_queued_and_running(env):
    store, launcher, sched = env
    a = sched.submit(spec("a", nodes=2))["id"]
    b = sched.submit(spec("b", nodes=2))["id"]
    sched.step()
    assert sched.cancel(b)["state"] == "CANCELLED"  # queued: at once
    store.update_job(a, state="STARTING")
    sched.cancel(a)
    deadline = time.monotonic() + 5
    while a not in launcher.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.step()
    assert store.get_job(a)["state"] == "CANCELLED"  # the fake runner recorded nothing: the scheduler does
    assert launcher.launched == [a]


def test_restart_reattaches_live_runners_and_starts_new_ones_for_vanished_ones(env, tmp_path):
    store, launcher, sched = env
    live = sched.submit(spec("live"))["id"]
    gone = sched.submit(spec("gone"))["id"]
    waiting = sched.submit(spec("waiting", nodes=2))["id"]
    sched.step()
    for j in (live, gone):
        store.update_job(j, state="STARTING")
    unstarted = store.create_job({"resources": {"num_nodes": 1, "gpus_per_node": 1}}, name="unstarted")["id"]
    store.append_event(unstarted, {"time": time.time(), "kind": "admission", "state": "QUEUED",
                                   "data": {"nodes": ["node-0"]}})  # the server died right after admitting it
    # A new server over the same store: only `live` still has a runner.
    relaunch = FakeRunners()
    relaunch.known = {live}
    again = Scheduler(store, relaunch, StaticCluster(2, 2), vanish_grace_s=0.0)
    again.recover()
    assert store.get_job(live)["state"] == "STARTING"
    assert store.get_job(gone)["state"] == "STARTING" and relaunch.launched == [gone]  # a new runner goes on
    assert [e["data"]["reason"] for e in store.events(gone, kind="runner")] == ["runner_vanished"]
    assert store.get_job(waiting)["state"] == "QUEUED"
    assert store.get_job(unstarted)["state"] == "QUEUED"  # nothing of it ran: it is queued again
    # mutation: held slots not rebuilt -> waiting starts too early
    assert again.used_slots() == {"node-0": 2, "node-1": 2}
    again.step()
    assert relaunch.launched == [gone]  # `waiting` needs both nodes; `live` and `gone` hold them
    assert [e["state"] for e in store.events(live, kind="state")] == ["QUEUED", "STARTING"]  # nothing twice


def test_a_runner_gone_uncancelled_gets_the_short_exit_grace_a_cancelled_one_the_vanish_grace(tmp_path):
    store = JobStore(sqlite_url(tmp_path))
    launcher = FakeRunners()
    sched = Scheduler(store, launcher, StaticCluster(2, 2), vanish_grace_s=30.0, exit_grace_s=0.2)
    try:
        killed = sched.submit(spec("killed"))["id"]
        cancelled = sched.submit(spec("cancelled"))["id"]
        sched.step()
        sched.cancel(cancelled)
        launcher.alive.clear()  # both runners gone without a final state
        sched.step()
        assert launcher.launched == [killed, cancelled]  # both within their grace
        time.sleep(0.25)
        sched.step()
        # mutation: the vanish grace for every runner -> `killed` waits 30 s for its new runner
        assert launcher.launched == [killed, cancelled, killed]
        assert store.get_job(cancelled)["state"] != "CANCELLED"  # mutation: exit grace for a cancel too
    finally:
        store.close()
