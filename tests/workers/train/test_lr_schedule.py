"""The LR schedule against Megatron-Core's OptimizerParamScheduler.get_lr formulas.

Expected values are written out from Megatron's formulas here, in iterations (n = completed
updates), independently of workers/train/lr_schedule.py.
"""

import math

import pytest

from workers.train.lr_schedule import LRSchedule

MAX, MIN = 1e-3, 1e-4


def cos_coeff(ratio):
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_cosine_with_warmup_3_over_12_iterations():
    s = LRSchedule.from_iters(lr=MAX, min_lr=MIN, train_iters=12, global_batch_size=16, lr_warmup_iters=3,
                              lr_decay_style="cosine")
    # n completed updates -> LR of the next step (Megatron: num_steps = n * global_batch_size).
    expected = {
        0: 0.0, 1: MAX / 3, 2: 2 * MAX / 3, 3: MAX,  # linear warmup from lr_warmup_init = 0, n <= warmup
        4: MIN + (MAX - MIN) * cos_coeff(1 / 9),
        6: MIN + (MAX - MIN) * cos_coeff(3 / 9),
        7: MIN + (MAX - MIN) * 0.5 * (math.cos(math.pi * 4 / 9) + 1),
        9: MIN + (MAX - MIN) * 0.5 * (math.cos(math.pi * 6 / 9) + 1),
        12: MIN,  # end of decay: cos(pi) = -1
        13: MIN,  # past lr_decay_iters
    }
    for n, lr in expected.items():
        assert s.lr_for_update(n) == pytest.approx(lr, rel=1e-12, abs=1e-15), n
    # Iteration 1 runs with the LR at 0 samples; Megatron logs the LR after the step.
    applied = [s.lr_for_iteration(k) for k in range(1, 13)]
    assert applied[:4] == pytest.approx([0.0, MAX / 3, 2 * MAX / 3, MAX], abs=1e-15)
    assert applied[4] == pytest.approx(MIN + (MAX - MIN) * cos_coeff(1 / 9), rel=1e-12)
    logged = [s.logged_lr(k) for k in range(1, 13)]
    assert logged == pytest.approx([s.lr_for_iteration(k + 1) for k in range(1, 13)], rel=1e-15)
    assert logged[0] == pytest.approx(MAX / 3, rel=1e-12) and logged[-1] == pytest.approx(MIN, rel=1e-12)


def test_constant_still_warms_up_and_never_decays():
    s = LRSchedule.from_iters(lr=MAX, min_lr=MIN, train_iters=10, global_batch_size=8, lr_warmup_iters=4,
                              lr_decay_style="constant")
    assert [s.lr_for_update(n) for n in (0, 2, 4, 5, 10, 50)] == pytest.approx(
        [0.0, MAX / 2, MAX, MAX, MAX, MAX], abs=1e-15)


def test_linear_with_warmup_fraction_and_warmup_init():
    # lr_warmup_fraction 0.25 of lr_decay_iters 8 -> 2 warmup iterations; decay runs to iteration 8.
    s = LRSchedule.from_iters(lr=MAX, min_lr=MIN, train_iters=20, global_batch_size=4, lr_warmup_fraction=0.25,
                              lr_decay_iters=8, lr_decay_style="linear", lr_warmup_init=2e-4)
    init = 2e-4
    assert s.lr_for_update(0) == pytest.approx(init)
    assert s.lr_for_update(1) == pytest.approx(init + (MAX - init) * 0.5)
    assert s.lr_for_update(2) == pytest.approx(MAX)
    assert s.lr_for_update(5) == pytest.approx(MIN + (MAX - MIN) * (1 - 3 / 6))
    assert s.lr_for_update(8) == pytest.approx(MIN)
    assert s.lr_for_update(9) == pytest.approx(MIN)


def test_inverse_square_root_counts_samples():
    # Megatron: max_lr * sqrt(max(warmup_samples, 1)) / sqrt(max(samples, 1)), floored at min_lr.
    s = LRSchedule.from_iters(lr=MAX, min_lr=MIN, train_iters=100, global_batch_size=4, lr_warmup_iters=2,
                              lr_decay_style="inverse-square-root")
    assert s.lr_for_update(2) == pytest.approx(MAX)
    assert s.lr_for_update(3) == pytest.approx(MAX * math.sqrt(8) / math.sqrt(12))
    assert s.lr_for_update(99) == pytest.approx(max(MIN, MAX * math.sqrt(8 / 396)))
    assert s.lr_for_update(101) == MIN  # past lr_decay_iters
    # Without warmup the sample count shows: 1/sqrt(samples), not 1/sqrt(iterations).
    s0 = LRSchedule.from_iters(lr=MAX, min_lr=0.0, train_iters=100, global_batch_size=4,
                               lr_decay_style="inverse-square-root")
    assert s0.lr_for_update(0) == pytest.approx(MAX)
    assert s0.lr_for_update(1) == pytest.approx(MAX / math.sqrt(4))
    assert s0.lr_for_update(9) == pytest.approx(MAX / 6)


@pytest.mark.parametrize("style, coeff_at_half", [
    ("exponential", 2.0 * 0.5**0.5 - 1.0),
    ("linear", 0.5),
    ("cosine", 0.5),
    ("minus_sqrt", 1.0 - math.sqrt(0.5)),
])
def test_wsd_stable_then_anneal(style, coeff_at_half):
    s = LRSchedule.from_iters(lr=MAX, min_lr=MIN, train_iters=10, global_batch_size=2, lr_warmup_iters=2,
                              lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_style=style)
    assert s.lr_for_update(1) == pytest.approx(MAX / 2)
    assert [s.lr_for_update(n) for n in (2, 3, 6)] == pytest.approx([MAX] * 3)  # stable up to 10 - 4
    assert s.lr_for_update(8) == pytest.approx(MIN + (MAX - MIN) * coeff_at_half)
    assert s.lr_for_update(10) == pytest.approx(MIN, abs=1e-15)
    assert s.lr_for_update(11) == MIN


def test_wsd_default_anneal_is_exponential():
    s = LRSchedule.from_iters(lr=MAX, train_iters=10, global_batch_size=2, lr_decay_style="WSD",
                              lr_wsd_decay_iters=4)
    assert s.lr_for_update(7) == pytest.approx(MAX * (2.0 * 0.5**0.25 - 1.0))


def test_lr_decay_iters_defaults_to_train_iters():
    s = LRSchedule.from_iters(lr=MAX, train_iters=10, global_batch_size=3, lr_decay_style="linear")
    assert s.lr_for_update(5) == pytest.approx(MAX * 0.5)
    assert s.lr_for_update(10) == pytest.approx(0.0, abs=1e-18)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr_warmup_iters=2, lr_warmup_fraction=0.1), "only one of lr_warmup_iters"),
    (dict(lr_warmup_iters=10), "warmup .* must be shorter than lr_decay_iters"),
    (dict(lr_decay_style="WSD"), "needs lr_wsd_decay_iters"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=11), "lr_wsd_decay_iters"),
    (dict(lr_decay_style="cosin"), "lr_decay_style 'cosin' is not one of"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=2, lr_wsd_decay_style="sqrt"), "lr_wsd_decay_style"),
    (dict(min_lr=2e-3), "min_lr"),
    (dict(lr_decay_iters=0), "lr_decay_iters must be positive"),
])
def test_refused_like_megatron(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRSchedule.from_iters(lr=MAX, train_iters=10, global_batch_size=2, **kwargs)


def test_iterations_are_one_based():
    s = LRSchedule.from_iters(lr=MAX, train_iters=10, global_batch_size=2)
    with pytest.raises(ValueError, match="1-based"):
        s.lr_for_iteration(0)


# --- the spec fields --------------------------------------------------------------------------

from service.spec.spec import parse_spec, to_job_config  # noqa: E402


def spec(**training):
    return {"training": {"train_iters": 12, "global_batch_size": 4, "micro_batch_size": 2, **training}}


def test_spec_fields_reach_the_schedule():
    job = to_job_config(parse_spec(spec(lr=1e-3, min_lr=1e-4, lr_warmup_iters=3, lr_decay_style="cosine")))
    t = job.training
    assert (t.min_lr, t.lr_warmup_iters, t.lr_decay_style, t.lr_decay_iters) == (1e-4, 3, "cosine", None)
    s = LRSchedule.from_config(t)
    assert s.lr_for_iteration(2) == pytest.approx(1e-3 / 3)
    assert s.lr_for_update(12) == pytest.approx(1e-4)
    w = to_job_config(parse_spec(spec(lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_style="linear",
                                      lr_warmup_fraction=0.25, lr_decay_iters=8))).training
    assert LRSchedule.from_config(w).lr_for_update(6) == pytest.approx(1e-3 * 0.5)


@pytest.mark.parametrize("fields, needle", [
    (dict(lr_warmup_iters=2, lr_warmup_fraction=0.1), "set only one of lr_warmup_iters (2) and lr_warmup_fraction"),
    (dict(lr_warmup_iters=12), "must be shorter than lr_decay_iters (12)"),
    (dict(lr_warmup_iters=5, lr_decay_iters=4), "must be shorter than lr_decay_iters (4)"),
    (dict(min_lr=0.1), "min_lr (0.1) <= lr (0.001)"),
    (dict(lr_decay_style="WSD"), "WSD needs lr_wsd_decay_iters"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=13), "lr_wsd_decay_iters (13)"),
    (dict(lr_decay_style="cosine-ish"), "training.lr_decay_style"),
    (dict(lr_wsd_decay_style="sqrt"), "training.lr_wsd_decay_style"),
    (dict(lr_warmup_fraction=1.5), "training.lr_warmup_fraction"),
    (dict(lr_warmup_iters=-1), "training.lr_warmup_iters"),
    (dict(lr_decay_iters=0), "training.lr_decay_iters"),
    (dict(min_lr=-1.0), "training.min_lr"),
])
def test_bad_schedule_fields_are_refused(fields, needle):
    with pytest.raises(ValueError) as e:
        parse_spec(spec(**fields))
    assert needle in str(e.value), str(e.value)
