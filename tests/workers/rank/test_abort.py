"""A restart's fast paths on a rank: a train step ended from another thread when a peer dies, and rank 0's TCP store listening before the others join."""

from __future__ import annotations

import threading
import time

import pytest

from workers.rank.abort import StepAbort, StepAborted


def test_an_abort_ends_a_running_step_at_once_and_puts_the_grad_mode_back():
    import torch

    abort, out = StepAbort(), {}

    def step() -> None:
        try:
            with abort.window():
                torch.set_grad_enabled(False)  # as a no_grad whose __enter__ the abort cut short
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < 10:  # computing: no collective would fail it
                    torch.ones(4).sum()
        except StepAborted:
            out["after_s"] = time.perf_counter() - t0
        out["grad"] = torch.is_grad_enabled()

    thread = threading.Thread(target=step)
    thread.start()
    time.sleep(0.2)
    assert abort.abort() is True  # the step was running
    thread.join(timeout=5)
    assert out["after_s"] < 1.0 and out["grad"] is True
    with pytest.raises(StepAborted, match="before the step"):  # an abort stays asked for: the next step ends at once
        with abort.window():
            pass


def test_an_abort_between_steps_ends_the_next_one_and_leaves_the_rest_alone():
    abort = StepAbort()
    with abort.window():
        pass
    assert abort.abort() is False  # no step running: nothing raised here
    time.sleep(0.05)
    with pytest.raises(StepAborted):
        with abort.window():
            pass


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
