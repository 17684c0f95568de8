"""What every rank process does to join a job: pick a free port, its device, and the default process group; and to leave it.

Each rank sets one intra-op thread (ranks share the cores), joins a process group on a
rendezvous address (gloo on CPU, nccl when CUDA is present: the same code selects it). A rank
that outlives a failed attempt (a Ray actor) leaves torch.distributed at once and frees the
attempt's groups and trainer on a thread of its own (:func:`leave_process_groups`,
:func:`release_in_background`).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_device(local_rank: int = 0):
    """The device a rank computes on: its GPU when CUDA is present, else the CPU."""
    import torch

    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    *,
    backend: str | None = None,
    timeout_s: float = 120.0,
    store=None,
) -> str:
    """Join the default process group; returns the backend used.

    The timeout is the hang detector: a peer that stops answering turns into an error on
    every other rank after ``timeout_s`` instead of a silent hang. ``store``: rank 0's TCP store,
    listening already (:func:`listening_store`), in place of the one ``tcp://`` would start.
    """
    import torch
    import torch.distributed as dist

    backend = backend or default_backend()
    if backend == "gloo" and master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # The keys under the prefix the ranks that join through tcp:// use (torch adds it to theirs only).
    where = ({"store": dist.PrefixStore("default_pg", store)} if store is not None
             else {"init_method": f"tcp://{master_addr}:{master_port}"})
    dist.init_process_group(
        backend,
        **where,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


def listening_store(host: str, world_size: int, timeout_s: float):
    """Rank 0's TCP store, listening from now on a port the kernel chose (``.port``). Started before
    the other ranks are told the address, so that none of them connects before it listens: a
    client that does waits out torch's connect backoff (0.75 s for one 50 ms early)."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def process_groups() -> list:
    """Every process group this process holds, the default group included (none: [])."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def leave_process_groups(held: list = ()) -> list:
    """Leave torch.distributed (a new ``init_process_group`` may follow at once) and return every
    group it held (:func:`process_groups`) and those of ``held``, still alive: their connections
    close when the last reference goes (:func:`release_in_background`), not here."""
    import torch.distributed as dist

    groups = list({id(g): g for g in (*held, *process_groups())}.values())
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on a rank that is failing anyway
            pass
    return groups


def release_in_background(groups: list) -> list:
    """Drop the last references to ``groups`` (what :func:`leave_process_groups` returned, once
    nothing else holds them), one thread each; returns the threads. A gloo group's destructor
    waits for its connections to close, ~10 ms per peer with the GIL released: one after the
    other that is 0.2-0.3 s for a rank of an 8-rank job, side by side the slowest group's
    ~50 ms, and the caller answers at once. The peers blocked in a collective with this rank
    fail as the connections close."""
    import threading

    threads = []
    while groups:
        box = [groups.pop()]
        thread = threading.Thread(target=box.clear, name="raytron-release", daemon=True)
        thread.start()
        threads.append(thread)
        del box
    return threads
