"""What train_step reports: Megatron's LR values, evaluation iterations, every metric key;
the LR schedule's position through the checkpoint hooks."""

import math

import pytest

from tests.helpers.parity import job_of, tiny_spec

KEYS = {"iteration", "loss", "moe_aux_loss", "mtp_loss", "lr", "grad_norm", "loss_scale", "skipped", "val_loss", "tokens_per_s",
        "step_time_s", "peak_mem_mb"}


def _trainer(training, model=None):
    from workers.train.trainer import Trainer

    return Trainer(job_of(tiny_spec(model={"num_layers": 2, **(model or {})}, training=training)), 0, 1)


def megatron_lr(iteration: int, *, lr, min_lr, warmup_iters, decay_iters, gbs) -> float:
    """Megatron's OptimizerParamScheduler.get_lr (cosine), written out here independently:
    the LR applied by 1-based ``iteration`` is get_lr at (iteration - 1) * gbs samples."""
    num_steps, warmup, decay = (iteration - 1) * gbs, warmup_iters * gbs, decay_iters * gbs
    if warmup > 0 and num_steps <= warmup:
        return lr * float(num_steps) / float(warmup)
    if num_steps > decay:
        return min_lr
    ratio = float(num_steps - warmup) / float(decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


def test_cosine_with_warmup_3_over_12_iterations_reports_megatrons_lr():
    t = _trainer({"train_iters": 12, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 3, "lr_decay_style": "cosine",
                  "eval_interval": None})
    got = [t.train_step()["lr"] for _ in range(12)]
    want = [megatron_lr(k, lr=3e-3, min_lr=3e-4, warmup_iters=3, decay_iters=12, gbs=8) for k in range(1, 13)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got[0] == 0.0 and got[3] == pytest.approx(3e-3) and got[-1] > 3e-4
    assert t.optimizer.lr == got[-1]  # the value the optimizer applied


def test_every_metric_and_evaluation_iterations():
    t = _trainer({"train_iters": 5, "eval_interval": 2, "eval_iters": 2})
    metrics = [t.train_step() for _ in range(5)]
    assert all(set(m) == KEYS for m in metrics)
    # Megatron evaluates after iterations 2 and 4, and once more at the end of training.
    assert [m["val_loss"] is not None for m in metrics] == [False, True, False, True, True]
    assert all(4.0 < m["val_loss"] < 6.0 for m in metrics if m["val_loss"] is not None)
    assert [m["iteration"] for m in metrics] == [1, 2, 3, 4, 5]
    assert all(m["loss_scale"] == 1.0 and m["skipped"] == 0 and m["grad_norm"] > 0 for m in metrics)
    assert all(m["tokens_per_s"] > 0 and m["step_time_s"] > 0 and m["peak_mem_mb"] > 0 for m in metrics)


def test_evaluation_does_not_change_training():
    moe = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}
    runs = []
    for interval in (None, 1):
        t = _trainer({"train_iters": 3, "eval_interval": interval, "eval_iters": 1}, model=moe)
        runs.append([(m["loss"], m["moe_aux_loss"], m["grad_norm"]) for m in (t.train_step() for _ in range(3))])
    assert runs[0] == runs[1]


def test_lr_schedule_position_survives_the_checkpoint_hooks():
    cfg = {"train_iters": 12, "lr_warmup_iters": 2, "lr_decay_style": "linear", "eval_interval": None}
    a = _trainer(cfg)
    for _ in range(4):
        a.train_step()
    state = a.state_for_checkpoint()
    assert state["lr_schedule"]["completed_updates"] == 4
    b = _trainer(cfg)
    b.load_state_from_checkpoint(state)
    assert [b.train_step()["lr"] for _ in range(3)] == [a.train_step()["lr"] for _ in range(3)]


def test_tensorboard_scalars_with_megatrons_names(tmp_path):
    from workers.train.tensorboard import crc32c, read_scalars

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    t = _trainer({"train_iters": 2, "eval_interval": 2, "eval_iters": 1, "tensorboard_dir": str(tmp_path / "tb")})
    metrics = [t.train_step() for _ in range(2)]
    (path,) = (tmp_path / "tb").iterdir()
    assert path.name.startswith("events.out.tfevents.")
    scalars = {(step, tag): value for step, tag, value in read_scalars(str(path))}
    for m in metrics:
        k = m["iteration"]
        assert scalars[(k, "lm loss")] == pytest.approx(m["loss"], rel=1e-6)
        assert scalars[(k, "learning-rate")] == pytest.approx(m["lr"], rel=1e-6)
        assert scalars[(k, "grad-norm")] == pytest.approx(m["grad_norm"], rel=1e-6)
        assert scalars[(k, "loss-scale")] == 1.0
    assert scalars[(2, "lm loss validation")] == pytest.approx(metrics[1]["val_loss"], rel=1e-6)
    assert (1, "lm loss validation") not in scalars


def test_val_loss_is_the_mean_token_loss_of_the_validation_batches():
    import torch
    import torch.nn.functional as F

    t = _trainer({"train_iters": 2, "eval_interval": 2, "eval_iters": 3})
    t.train_step()
    val = t.train_step()["val_loss"]
    losses = []
    with torch.no_grad():
        for k in range(3):  # evaluation 0 reads validation global batches 0, 1, 2
            tokens, labels = t.sampler.validation_batch(0, k, 3)
            logits = t.chunks[0](tokens.t()).float()
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1)).item())
    assert val == pytest.approx(sum(losses) / 3, rel=1e-6)
    train_tokens, _ = t.sampler.batch(1)
    assert not torch.equal(train_tokens, t.sampler.validation_batch(0, 0, 3)[0])
