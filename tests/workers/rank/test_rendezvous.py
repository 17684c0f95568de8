"""Rank 0's TCP store listening before the other ranks join (no connect backoff at a restart): they join it through tcp://."""

from __future__ import annotations

import pytest


def _store_rank(rank: int, port_q) -> None:
    import torch
    import torch.distributed as dist

    from workers.rank.distributed import init_distributed, listening_store

    if rank == 0:
        store = listening_store("127.0.0.1", 2, 10)
        port_q.put(store.port)
        init_distributed(0, 2, "127.0.0.1", store.port, backend="gloo", timeout_s=10, store=store)
    else:
        init_distributed(1, 2, "127.0.0.1", port_q.get(timeout=30), backend="gloo", timeout_s=10)
    t = torch.ones(2)
    dist.all_reduce(t)
    port_q.put((rank, t.tolist()))
    dist.destroy_process_group()


@pytest.mark.procs
def test_rank_0_s_listening_store_takes_the_ranks_that_join_through_tcp():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_store_rank, args=(r, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    got = []
    while not q.empty():
        got.append(q.get())
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(g for g in got if isinstance(g, tuple)) == [(0, [2.0, 2.0]), (1, [2.0, 2.0])]
