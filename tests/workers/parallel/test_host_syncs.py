"""At most one host sync per training iteration on the dense path (issue 19, item 6).

A host sync (``.item()``, ``float(tensor)``, ``tolist``, a device-to-host copy, a
data-dependent shape) drains the CUDA queue; on CPU it costs nothing, so the syncs are counted
by what they are, with :class:`bench.moe_bench.HostSyncCounter`. The step's one read is the
``tolist`` of the loss, grad norm and skip flags together; clipping, the non-finite skip and
fp16's overflow skip stay on the device.

The data sampler draws each sample's offset from a CPU ``torch.Generator`` and reads it with
``int()``: host memory, no device involved, but the counter cannot tell a CPU tensor the data
loader owns from a device tensor. So the iteration's batch is read before the counted step
(as a prefetching loader would) and served from memory inside it.
"""

from __future__ import annotations

import pytest

from bench.moe_bench import HostSyncCounter
from tests.helpers.parity import job_of, tiny_spec

DENSE = {"num_layers": 2}


def _count_one_step(rank: int, world_size: int, job) -> list[str]:
    """Sync events of one ``train_step`` (after a warm-up step), batches read beforehand."""
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world_size)
    try:
        trainer.train_step()
        real_batch = trainer.sampler.batch
        t = job.training
        loaded = {(start, count): real_batch(trainer.iteration, start, count)
                  for start in range(0, t.global_batch_size, t.micro_batch_size)
                  for count in (t.micro_batch_size,)}
        trainer.sampler.batch = lambda iteration, start=0, count=None, split="train": loaded[(start, count)]
        with HostSyncCounter() as counter:
            metrics = trainer.train_step()
        assert metrics["grad_norm"] > 0 and metrics["skipped"] == 0
        return counter.events
    finally:
        trainer.close()


def _job(training: dict, *, world: int = 1, parallel: dict | None = None):
    # No evaluation in the counted step: it is an extra forward pass with its own loss read.
    return job_of(tiny_spec(model=DENSE, world=world, parallel=parallel,
                            training={"eval_interval": None, **training}))


@pytest.mark.parametrize("precision", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_one_host_sync_per_dense_step(precision):
    events = _count_one_step(0, 1, _job(precision))
    assert len(events) <= 1, f"host syncs in one dense step: {events}"


def test_fp16_loss_scaling_adds_no_host_sync():
    """The overflow check and the skip decision stay on the device; the flag rides in the one read."""
    events = _count_one_step(0, 1, _job({"fp16": True, "initial_loss_scale": 2.0**8}))
    assert len(events) <= 1, f"host syncs in one fp16 step: {events}"


@pytest.mark.slow
def test_one_host_sync_per_dense_step_tp2():
    from tests.helpers.ranks import run_ranks

    job = _job({}, world=2, parallel={"tensor_model_parallel_size": 2})
    per_rank = run_ranks(_count_one_step, 2, args=(job,), timeout_s=300)
    assert all(len(events) <= 1 for events in per_rank), f"host syncs per rank: {per_rank}"


def test_fp16_overflow_is_still_skipped_on_the_device():
    """An inf in the grads: no update, the scale backs off after ``hysteresis`` overflows, and the
    step is reported skipped with no grad norm, all decided from the one read."""
    import torch

    from workers.train.trainer import Trainer

    trainer = Trainer(_job({"fp16": True, "initial_loss_scale": 2.0**8}), 0, 1)
    try:
        before = [p.detach().clone() for p in trainer.chunks[0].parameters()]
        hook = trainer.chunks[0].parameters().__next__().register_hook(lambda g: torch.full_like(g, float("inf")))
        metrics = [trainer.train_step() for _ in range(2)]
        hook.remove()
        assert [(m["skipped"], m["grad_norm"]) for m in metrics] == [(1, None), (1, None)]
        assert trainer.optimizer.num_steps == 0 and trainer.grad_scaler.scale == 2.0**7
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.chunks[0].parameters()))
        ok = trainer.train_step()
        assert ok["skipped"] == 0 and ok["grad_norm"] > 0 and trainer.optimizer.num_steps == 1
    finally:
        trainer.close()


def test_non_finite_grad_norm_is_reported_and_leaves_the_weights():
    """A nan grad (fp32): the step reports the nan norm for the controller's finite check and
    skips the update on the device, without a second read."""
    import math

    import torch

    from workers.train.trainer import Trainer

    trainer = Trainer(_job({}), 0, 1)
    try:
        before = [p.detach().clone() for p in trainer.chunks[0].parameters()]
        hook = trainer.chunks[0].parameters().__next__().register_hook(lambda g: torch.full_like(g, float("nan")))
        with HostSyncCounter() as counter:
            metrics = trainer.train_step()
        hook.remove()
        assert math.isnan(metrics["grad_norm"]) and metrics["skipped"] == 1 and trainer.optimizer.num_steps == 0
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.chunks[0].parameters()))
        # The sampler's 8 CPU-generator reads (not device syncs), then the step's one read.
        assert counter.events.count("tolist") == 1 and len(counter.events) <= 1 + 8, counter.events
    finally:
        trainer.close()
