"""Rank functions for the GPU benchmark (module level, so that spawned processes can import them)."""

from __future__ import annotations


def losses_on_gpu(rank, world_size, job, iters):
    import torch

    from workers.rank.distributed import rank_device
    from workers.train.trainer import Trainer

    assert torch.distributed.get_backend() == "nccl", torch.distributed.get_backend()
    trainer = Trainer(job, rank, world_size, device=rank_device(rank))
    devices = {str(p.device) for chunk in trainer.chunks for p in chunk.parameters()}
    return [trainer.train_step()["loss"] for _ in range(iters)], sorted(devices)
