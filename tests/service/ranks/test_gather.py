"""The failure triage both launchers share (service/ranks/gather.py), against scripted answers."""

from __future__ import annotations

import pytest

from service.control.errors import JobError, RankDied, RankHung, RankRaised
from service.ranks.gather import collect, peer_summary

PEER = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


def scripted(*batches):
    """A poll that hands out one batch per call, then nothing (a rank that never answers)."""
    batches = list(batches)

    def poll(pending, timeout):
        return [(r, v) for r, v in batches.pop(0) if r in pending] if batches else []

    return poll


def where(rank):
    return {"node": rank // 2, "pid": 100 + rank}


def raised(rank, cause):
    return RankRaised(rank, where(rank), cause)


def test_all_answer():
    assert collect([0, 1], scripted([(1, "b"), (0, "a")]), where=where, grace_s=1) == {0: "a", 1: "b"}


def test_a_death_beats_the_peer_symptoms_that_arrived_first():
    poll = scripted([(0, raised(0, PEER))], [(2, RankDied(2, where(2), "process exited with code 1"))])
    with pytest.raises(RankDied) as e:
        collect([0, 1, 2], poll, where=where, grace_s=5)
    assert e.value.rank == 2


def test_a_silent_rank_among_peer_symptoms_is_named_hung_with_its_collective():
    poll = scripted([(0, raised(0, PEER)), (1, raised(1, "RuntimeError: Timed out waiting 5000ms"))])
    with pytest.raises(RankHung) as e:
        collect([0, 1, 2, 3], poll, where=where, grace_s=0.05,
                stall_hint=lambda r: "tp all_reduce" if r == 3 else "")
    assert e.value.rank == 3 and e.value.where["group"] == "tp" and "ranks [2] also silent" in e.value.cause
    assert "blocked in all_reduce on its tp group" in str(e.value) and ".cc:" not in str(e.value)


def test_progress_watch_names_a_rank_that_lags_its_peers():
    with pytest.raises(RankHung) as e:
        collect([0, 1, 2], scripted([(0, "ok"), (2, "ok")]), where=where, grace_s=1, stall_s=0.05, what="run")
    assert e.value.rank == 1 and "no answer to run" in e.value.cause and e.value.where == {"node": 0, "pid": 101}


def test_only_symptoms_and_nobody_silent_names_the_first():
    poll = scripted([(1, raised(1, PEER)), (0, raised(0, PEER))])
    with pytest.raises(RankRaised) as e:
        collect([0, 1], poll, where=where, grace_s=1)
    assert e.value.rank == 1


def test_start_timeout_without_failures():
    with pytest.raises(JobError, match=r"ranks \[1\] did not start within 0s"):
        collect([0, 1], scripted([(0, "ok")]), where=where, grace_s=1, timeout_s=0.05, what="start")


def test_peer_summary_drops_source_locations():
    assert peer_summary(PEER) == "RuntimeError: Connection closed by peer [127.0.0.1]:4242"
