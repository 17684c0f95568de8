"""Layout invariance, dense model: every layout gives the single-process run (see parity.py:
losses to 1e-6, iteration-0 gradients to 1e-5, replicas bit-equal)."""

import pytest

from tests.helpers.parity import check_layout, job_of, reference, run_trainer, tiny_spec
from tests.helpers.layouts import DENSE_LAYOUTS, light

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(DENSE_LAYOUTS))
def test_dense_layout_matches_single_process(name):
    world, parallel, model, training = (DENSE_LAYOUTS[name] + ({}, {}))[:4]
    model, training = light(parallel, model, training)
    check_layout(tiny_spec(world=world, parallel=parallel, model=model, training=training), model, training)


def test_loss_falls_on_builtin_tiny():
    job = job_of(tiny_spec(training={"train_iters": 20, "lr": 1e-2}))
    losses = run_trainer(0, 1, job, iters=20)["losses"]
    assert losses[0] > 5.0  # ~ln(256) at init
    assert losses[-1] < losses[0] - 1.0, losses


def test_moe_aux_loss_reported_apart_from_lm_loss():
    from workers.train.trainer import Trainer

    no_aux = Trainer(job_of(tiny_spec(moe=True, model={"moe_aux_loss_coeff": 0.0})), 0, 1).train_step()
    with_aux = Trainer(job_of(tiny_spec(moe=True, model={"moe_aux_loss_coeff": 0.01})), 0, 1).train_step()
    assert no_aux["moe_aux_loss"] == 0.0
    # 4 layers x coeff x (E * sum f_e P_e ~ 1 for a near-uniform router at init)
    assert 0.03 < with_aux["moe_aux_loss"] < 0.06
    # The first iteration's LM loss is computed before any update: the aux term is not in it.
    assert with_aux["loss"] == no_aux["loss"]


def test_reference_covers_every_parameter():
    ref = reference()
    assert len(ref["grads"]) == 2 + 4 * 6 + 1  # embedding, output, final norm; 6 per layer
    assert all(abs(g).max() > 0 for g in ref["grads"].values())
