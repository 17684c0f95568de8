"""bf16 / fp16 mixed precision: fp32 main params and main grads, layouts agree within what
bf16 allows, fp16's dynamic loss scaler (skipped steps, LR not advanced), checkpoints keep
the fp32 main params and the scaler."""

import pytest
import torch

from tests.helpers.parity import check_layout, job_of, metric, reference, run_trainer, tiny_spec
from workers.train.mixed_precision import DynamicGradScaler
from tests.helpers.layouts import BF16, BF16_TOL, light

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}
# bf16 rounds to 8 bits of mantissa: layouts agree with the single bf16 process to ~1e-5 in
# the loss and ~1e-3 in the grad norm here; the bounds leave room for other shapes.
# A token whose top-k logits nearly tie can switch experts under bf16 rounding: an expert's
# gradient then moves by that token's share (measured 8e-2 of the largest element), and the
# gradient norm with it: 1.6e-2 at moe-aux1-tp2-sp-cp2 once ring attention kept bf16 on the wire
# and the norm, RoPE and SwiGLU were fused (each alone stayed under 1e-2; fp32 parity of the same
# layout holds at 1e-6, so the math is the same).
BF16_MOE_TOL = {**BF16_TOL, "grad_rtol": 0.2, "norm_rtol": 3e-2}

BF16_LAYOUTS = {
    "tp2-sp": (False, 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2-vpp2": (False, 2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "dp2-distopt": (False, 2, {"use_distributed_optimizer": True}),
    "cp2-tp2-sp": (False, 4, {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "moe-tp2-sp-ep2": (True, 4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                 "expert_model_parallel_size": 2}),
}


def _trainer(training, model=None, parallel=None):
    from workers.train.trainer import Trainer

    return Trainer(job_of(tiny_spec(model={"num_layers": 2, **(model or {})}, parallel=parallel,
                                    training={"eval_interval": None, **training})), 0, 1)


@pytest.mark.parametrize("distributed", [False, True])
def test_bf16_model_with_fp32_main_params_and_grads(distributed):
    t = _trainer(BF16, parallel={"use_distributed_optimizer": distributed})
    params = [p for c in t.chunks for p in c.parameters()]
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert all(buf.grad.dtype == torch.float32 and buf.main_grads for buf in t.optimizer.grads.buffers)
    masters = ([s["param"] for s in t.optimizer.shards] if distributed
               else [m for ms in t.optimizer.masters for m in ms])
    assert {m.dtype for m in masters} == {torch.float32}
    # The main params start from the fp32 init, not from its bf16 rounding.
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)
    m = t.train_step()
    assert {p.dtype for p in params} == {torch.bfloat16} and all(p.grad is None for p in params)
    assert m["loss_scale"] == 1.0 and m["skipped"] == 0 and m["grad_norm"] > 0


@pytest.mark.slow
def test_bf16_trains_and_stays_within_a_few_percent_of_fp32():
    cfg = {"train_iters": 12, "lr": 1e-2}
    fp32 = run_trainer(0, 1, job_of(tiny_spec(training=cfg)), iters=12)["losses"]
    bf16 = run_trainer(0, 1, job_of(tiny_spec(training={**cfg, **BF16})), iters=12)["losses"]
    assert bf16[-1] < bf16[0] - 0.5, bf16
    assert max(abs(a - b) / b for a, b in zip(bf16, fp32)) < 0.02, (bf16, fp32)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BF16_LAYOUTS))
def test_bf16_layout_agrees_with_single_bf16_process(name):
    moe, world, parallel = BF16_LAYOUTS[name]
    model, training = light(parallel, None, BF16)
    per_rank = check_layout(tiny_spec(moe=moe, world=world, parallel=parallel, model=model, training=training),
                            {**(MOE if moe else {}), **model}, training, **(BF16_MOE_TOL if moe else BF16_TOL))
    losses = per_rank[0]["losses"]
    assert losses[-1] < losses[0]  # trains


@pytest.mark.slow
def test_bf16_full_5d_moe_layout_16_ranks():
    parallel = {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "pipeline_model_parallel_size": 2,
                "expert_model_parallel_size": 2, "sequence_parallel": True, "use_distributed_optimizer": True}
    model, training = light(parallel, None, BF16)
    spec = tiny_spec(moe=True, world=16, model=model, training=training, parallel=parallel)
    spec["resources"] = {"num_nodes": 2, "gpus_per_node": 8}
    per_rank = check_layout(spec, {**MOE, **model}, training, **BF16_MOE_TOL)
    assert per_rank[0]["losses"][-1] < per_rank[0]["losses"][0]


def test_dynamic_grad_scaler_follows_megatron():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0  # hysteresis: the first overflow only spends the budget
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 2.0  # the budget refills only on growth
    s.update(True)
    assert s.scale == 2.0  # min_scale
    for _ in range(3):
        s.update(False)
    assert s.scale == 4.0 and s.hysteresis_tracker == 2
    s.update(True)
    assert s.scale == 4.0
    defaults = DynamicGradScaler()
    assert (defaults.scale, defaults.min_scale, defaults.growth_interval, defaults.hysteresis) == (2.0**32, 1.0, 1000, 2)


FP16 = {"fp16": True, "initial_loss_scale": 2.0**20, "train_iters": 8, "lr_decay_style": "linear"}


def test_fp16_skips_overflow_steps_without_advancing_the_lr():
    t = _trainer(FP16)
    metrics = [t.train_step() for _ in range(8)]
    skipped = [m["skipped"] for m in metrics]
    assert 0 < sum(skipped) < 8 and t.num_skipped == sum(skipped)
    updates = 0
    for m in metrics:
        assert m["lr"] == t.lr_schedule.lr_for_update(updates)  # skips do not advance the schedule
        assert (m["grad_norm"] is None) == bool(m["skipped"])
        updates += 1 - m["skipped"]
    assert t.optimizer.num_steps == updates
    scales = [m["loss_scale"] for m in metrics]
    assert scales[0] == 2.0**20 and scales[-1] < scales[0] and all(b <= a for a, b in zip(scales, scales[1:]))
    assert metrics[-1]["loss"] < metrics[0]["loss"]


@pytest.mark.slow
def test_fp16_dp2_layout_skips_the_same_steps():
    check_layout(tiny_spec(world=2, training=FP16), None, FP16, **BF16_TOL)


@pytest.mark.parametrize("training", [{**BF16}, {**BF16, "distopt": True}, {**FP16}])
def test_resume_keeps_fp32_main_params_and_scaler(tmp_path, training):
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.reader import load_checkpoint

    training = dict(training)
    parallel = {"use_distributed_optimizer": training.pop("distopt", False)}
    t = _trainer(training, parallel=parallel)
    for _ in range(3):
        t.train_step()
    Checkpointer(str(tmp_path)).save(t)
    want = [t.train_step() for _ in range(3)]
    fresh = _trainer(training, parallel=parallel)
    load_checkpoint(fresh, str(tmp_path))
    got = [fresh.train_step() for _ in range(3)]
    for key in ("loss", "grad_norm", "loss_scale", "skipped", "lr"):
        assert [m[key] for m in got] == [m[key] for m in want], key


def test_fp16_gradients_are_fp32_gradients_times_the_loss_scale():
    """Iteration 0's reduced grads (before unscaling) over the loss scale are fp32's, the MoE
    aux loss's gradient (which dominates the router at coefficient 1) included."""
    import numpy as np

    moe = {**MOE, "moe_aux_loss_coeff": 1.0}
    fp16 = {"fp16": True, "initial_loss_scale": 2.0**10}
    got = run_trainer(0, 1, job_of(tiny_spec(moe=True, model=moe, training=fp16)), iters=1)
    want = run_trainer(0, 1, job_of(tiny_spec(moe=True, model=moe)), iters=1)
    assert got["metrics"][0]["skipped"] == 0
    for name, w in want["grads"].items():
        err = np.abs(got["grads"][name] / 2.0**10 - w).max() / np.abs(w).max()
        assert err < 5e-2, f"{name}: {err:.2e}"


def test_bf16_and_fp16_are_exclusive_and_the_fields_are_accepted():
    with pytest.raises(ValueError, match="exclusive"):
        job_of(tiny_spec(training={"bf16": True, "fp16": True}))
    t = job_of(tiny_spec(training={"fp16": True, "initial_loss_scale": 1024.0, "clip_grad": 0.0,
                                   "tensorboard_dir": "/tmp/x"})).training
    assert (t.fp16, t.bf16, t.initial_loss_scale, t.clip_grad, t.tensorboard_dir) == (True, False, 1024.0, 0.0, "/tmp/x")
    assert job_of(tiny_spec()).training.clip_grad == 0.05 and job_of({"name": "d"}).training.clip_grad == 1.0


def _parity_layouts() -> dict:
    """Every layout of the fp32 parity suites as (moe, world, parallel, model, training)."""
    from tests.helpers.layouts import DENSE_LAYOUTS
    from tests.helpers.layouts import LAYOUTS

    out = {}
    for name, v in DENSE_LAYOUTS.items():
        world, parallel, model, training = (v + ({}, {}))[:4]
        out[name] = (False, world, parallel, model or {}, training or {})
    for name, v in LAYOUTS.items():
        moe, world, parallel, training, model = (v + (None, None))[:5]
        out[name] = (moe, world, parallel, model or {}, training or {})
    return out


PARITY_LAYOUTS = _parity_layouts()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PARITY_LAYOUTS if n not in BF16_LAYOUTS])
def test_bf16_every_other_parity_layout_trains_and_agrees(name):
    """bf16 in every layout of the fp32 parity suites (beyond the ones above): it runs, the loss
    falls, and the layout agrees with the single bf16 process within what bf16 allows."""
    moe, world, parallel, model, training = PARITY_LAYOUTS[name]
    model, training = light(parallel, model, {**training, **BF16})
    model_all = {**(MOE if moe else {}), **model}
    per_rank = check_layout(tiny_spec(moe=moe, world=world, parallel=parallel, model=model, training=training),
                            model_all or None, training, **(BF16_MOE_TOL if moe else BF16_TOL))
    losses = per_rank[0]["losses"]
    assert losses[-1] < losses[0]  # trains
