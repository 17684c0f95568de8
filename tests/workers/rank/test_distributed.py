"""Leaving torch.distributed after a failed attempt: the groups come back alive, a new process group can follow at once, and the release threads drop them."""

from __future__ import annotations

import os

import pytest

from workers.rank.distributed import free_port, init_distributed, leave_process_groups, process_groups, release_in_background


@pytest.fixture
def world_of_one():
    """A gloo world of this process alone (no other process)."""
    import torch.distributed as dist

    init_distributed(0, 1, "127.0.0.1", free_port(), backend="gloo", timeout_s=10)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_left_groups_stay_alive_until_the_release_threads_drop_them(world_of_one):
    import threading
    import weakref

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sub = dist.new_group([0], backend="gloo")
    held = process_groups()
    assert sub in held and dist.group.WORLD in held
    groups = leave_process_groups(held)
    del held
    assert not dist.is_initialized()  # the next attempt's init_process_group may follow at once
    refs = [weakref.ref(g) for g in groups]
    assert len(refs) == 2 and all(r() is not None for r in refs)  # alive: no connection closed on the caller's thread
    freed_on: list = []
    for g in groups:
        weakref.finalize(g, lambda: freed_on.append(threading.current_thread().name))
    del g
    del sub
    init_distributed(0, 1, "127.0.0.1", free_port(), backend="gloo", timeout_s=10)
    threads = release_in_background(groups)
    assert groups == [] and len(threads) == 2
    for thread in threads:
        thread.join(timeout=10)
    assert all(r() is None for r in refs) and freed_on == ["raytron-release"] * 2  # freed by the threads, not the caller
    t = torch.ones(2)
    dist.all_reduce(t)  # the new world works beside them
    assert t.tolist() == [1.0, 1.0]
