"""What every rank process does to join a job: pick a free port, its device, and the default process group.

Each rank sets one intra-op thread (ranks share the cores), joins a process group on a
rendezvous address (gloo on CPU, nccl when CUDA is present: the same code selects it).
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
) -> str:
    """Join the default process group; returns the backend used.

    The timeout is the hang detector: a peer that stops answering turns into an error on
    every other rank after ``timeout_s`` instead of a silent hang.
    """
    import torch
    import torch.distributed as dist

    backend = backend or default_backend()
    if backend == "gloo" and master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend
