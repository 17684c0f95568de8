"""GPU paths: the same code on CUDA devices with nccl. Skipped (with the reason shown by -ra)
on machines without CUDA, such as CI."""

import pytest
import torch

from parity import ITERS, assert_same_curve, job_of, reference_losses, tiny_spec

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.gpu
@needs_cuda
def test_single_gpu_matches_cpu_reference():
    from workers.train import Trainer

    trainer = Trainer(job_of(tiny_spec()), 0, 1, device=torch.device("cuda", 0))
    losses = [trainer.train_step()["loss"] for _ in range(ITERS)]
    assert_same_curve(losses, reference_losses(False), rtol=1e-3)  # TF32/cuBLAS vs CPU BLAS


def _gpu_losses(rank, world_size, job):
    from workers.spawn import rank_device
    from workers.train import Trainer

    assert torch.distributed.get_backend() == "nccl"
    trainer = Trainer(job, rank, world_size, device=rank_device(rank))
    return [trainer.train_step()["loss"] for _ in range(ITERS)]


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("parallel", [{"tensor_model_parallel_size": 2, "sequence_parallel": True},
                                      {"pipeline_model_parallel_size": 2}, {"context_parallel_size": 2}])
def test_two_gpus_nccl_match_reference(parallel):
    from workers.spawn import run_ranks

    job = job_of(tiny_spec(world=2, parallel=parallel))
    losses = run_ranks(_gpu_losses, 2, args=(job,), start_method="spawn")[0]
    assert_same_curve(losses, reference_losses(False), rtol=1e-3)
