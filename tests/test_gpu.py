"""GPU paths: the same code on CUDA devices with nccl. Skipped (with the reason shown by -ra)
on machines without CUDA, such as CI."""

import pytest
import torch

from tests.helpers.parity import ITERS, assert_same_curve, job_of, reference, tiny_spec

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

# Activations of [seq 1024, micro batch 4, hidden 1024] fp32 = 16 MiB per pipeline message:
# far past what NCCL buffers, so a send really waits for its receive (the deadlock a
# wrong posting order would hit), unlike the parity model's 2 KiB messages.
LARGE = {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "num_query_groups": 8,
         "ffn_hidden_size": 2048, "vocab_size": 256, "seq_length": 1024}
LARGE_TRAINING = {"global_batch_size": 16, "micro_batch_size": 4}


@pytest.mark.gpu
@needs_cuda
def test_single_gpu_matches_cpu_reference():
    from workers.train.trainer import Trainer

    trainer = Trainer(job_of(tiny_spec()), 0, 1, device=torch.device("cuda", 0))
    losses = [trainer.train_step()["loss"] for _ in range(ITERS)]
    assert_same_curve(losses, reference()["losses"], rtol=1e-3)  # TF32/cuBLAS vs CPU BLAS


@pytest.mark.gpu
@needs_cuda
def test_scaled_mm_fp8_gemms_are_the_emulated_ones_on_cuda():
    """``training.fp8_gemm: scaled_mm`` on cuBLASLt (e4m3 x e4m3 forward, e5m2/e4m3 x e4m3
    backward, row-major x column-major, every dim a multiple of 16): the forward, input-gradient
    and weight-gradient GEMMs equal the emulated ones bit for bit on exact operands, per recipe
    and format, fp32 and bf16 (tests/workers/parallel/test_fp8_gemm.py on CPU); ``auto`` picks it."""
    from tests.helpers.fp8 import assert_scaled_mm_is_emulated_on_exact_operands
    from workers.parallel.fp8 import gemm_mode

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")
    assert gemm_mode("auto", "tensorwise", torch.device("cuda", 0)) == "scaled_mm"
    assert gemm_mode("auto", "blockwise", torch.device("cuda", 0)) == "emulated"
    assert_scaled_mm_is_emulated_on_exact_operands(torch.device("cuda", 0))


def _gpu_losses(rank, world_size, job, iters=ITERS):
    from workers.rank.distributed import rank_device
    from workers.train.trainer import Trainer

    if world_size > 1:
        assert torch.distributed.get_backend() == "nccl"
    trainer = Trainer(job, rank, world_size, device=rank_device(rank))
    nbytes = torch.Size(trainer.activation_shape).numel() * 4
    return {"losses": [trainer.train_step()["loss"] for _ in range(iters)], "activation_bytes": nbytes}


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("parallel", [{"tensor_model_parallel_size": 2, "sequence_parallel": True},
                                      {"pipeline_model_parallel_size": 2}, {"context_parallel_size": 2}])
def test_two_gpus_nccl_match_reference(parallel):
    from tests.helpers.ranks import run_ranks

    job = job_of(tiny_spec(world=2, parallel=parallel))
    losses = run_ranks(_gpu_losses, 2, args=(job,), start_method="spawn")[0]["losses"]
    assert_same_curve(losses, reference()["losses"], rtol=1e-3)


@pytest.mark.gpu
@needs_2_gpus
@pytest.mark.parametrize("vpp", [None, 2])
def test_pp2_nccl_with_16_mib_activations_matches_one_gpu(vpp):
    """1F1B (4 microbatches: a real steady state) and interleaved, with messages NCCL cannot
    buffer: the run finishes (no deadlock) and matches the same job on one GPU."""
    from tests.helpers.ranks import run_ranks

    parallel = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": vpp}
    job = job_of(tiny_spec(world=2, parallel=parallel, model=LARGE, training=LARGE_TRAINING))
    results = run_ranks(_gpu_losses, 2, args=(job, 2), start_method="spawn", timeout_s=600)
    assert results[0]["activation_bytes"] >= 16 * 2**20
    single = _gpu_losses(0, 1, job_of(tiny_spec(model=LARGE, training=LARGE_TRAINING)), 2)["losses"]
    assert_same_curve(results[0]["losses"], single, rtol=1e-4)
