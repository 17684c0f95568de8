"""The local rank spawner: results, failures, progress events and a rendezvous port clash."""

import socket

import pytest
import torch
import torch.distributed as dist

import tests.helpers.ranks as spawn
from tests.helpers.ranks import RankFailure, run_ranks

pytestmark = pytest.mark.procs


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t}


def _fail_on_1(rank, world_size):
    if rank == 1:
        raise ValueError("bad input on purpose")
    dist.barrier()


def _with_events(rank, world_size, report):
    report({"rank": rank})
    return rank


def test_results_in_rank_order_with_tensors():
    out = run_ranks(_sum_ranks, 3)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(float(o["sum"]) == 3.0 for o in out)


def test_failure_names_the_rank_and_carries_its_traceback():
    with pytest.raises(RankFailure) as e:
        run_ranks(_fail_on_1, 3, collective_timeout_s=10)
    assert e.value.rank == 1 and "bad input on purpose" in str(e.value) and "Traceback" in str(e.value)


def test_progress_events_reach_the_parent():
    seen = []
    assert run_ranks(_with_events, 2, on_event=lambda r, p: seen.append((r, p["rank"]))) == [0, 1]
    assert sorted(seen) == [(0, 0), (1, 1)]


def test_port_clash_is_retried(monkeypatch):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = iter([busy.getsockname()[1]])
    real = spawn.free_port
    monkeypatch.setattr(spawn, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    try:
        out = run_ranks(_sum_ranks, 2)
    finally:
        busy.close()
    assert [float(o["sum"]) for o in out] == [1.0, 1.0]
