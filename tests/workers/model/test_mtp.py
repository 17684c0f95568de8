"""Multi-token prediction (workers/model/mtp.py) in one process: the reported MTP loss is DeepSeek-V3's
definition computed by hand from the model's own pieces (shifted tokens, [enorm(emb); hnorm(h)], the
layer, the shared head, the positions past the end masked, each depth's mean over its valid tokens),
the LM loss is untouched by it, its weight only scales its gradient, and bad fields are refused.
(Layout invariance: test_mtp_parity.py.)"""

import pytest
import torch
import torch.nn.functional as F

from service.spec.spec import parse_spec
from tests.helpers.parity import job_of, tiny_spec

MTP2 = {"mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.5}


def _trainer(model, training=None):
    from workers.train.trainer import Trainer

    return Trainer(job_of(tiny_spec(model=model, training=training)), 0, 1)


def _by_hand(trainer) -> float:
    """Mean over depths of each depth's mean token loss over the global batch, from scratch."""
    chunk = trainer.chunks[0]
    tokens, labels = trainer.sampler.batch(0)
    tokens, labels = tokens.t(), labels.t()  # [s, b]
    s = tokens.shape[0]
    with torch.no_grad():
        _, hidden = chunk(tokens)
        depth_losses = []
        for k, module in enumerate(chunk.mtp.layers, start=1):
            shifted = torch.cat([tokens[k:], torch.zeros_like(tokens[:k])])
            x = module.eh_proj(torch.cat([module.enorm(chunk.embedding(shifted)), module.hnorm(hidden)], -1))
            hidden = module.layer(x, chunk.rotary)
            logits = chunk.output(module.final_norm(hidden))[: s - k]  # positions with a target
            depth_losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[k:].reshape(-1)))
    return float(sum(depth_losses) / len(depth_losses))


def test_mtp_loss_is_deepseek_v3s_definition_and_the_lm_loss_is_untouched():
    trainer = _trainer(MTP2, {"micro_batch_size": 2})
    want = _by_hand(trainer)
    got = trainer.train_step()
    assert got["mtp_loss"] == pytest.approx(want, rel=1e-6)
    plain = _trainer({}, {"micro_batch_size": 2}).train_step()
    assert got["loss"] == pytest.approx(plain["loss"], rel=1e-7)  # same init: MTP adds, never changes, the LM loss
    assert plain["mtp_loss"] is None


def _grads(trainer) -> dict:
    from tests.helpers.parity import _reduced_grads

    trainer.run_microbatches(trainer._microbatch)
    return _reduced_grads(trainer)


def test_the_scaling_factor_weighs_only_the_mtp_gradient():
    """factor 0: the main model's gradients are the plain model's and the MTP modules get none;
    factor f: every MTP-only gradient scales by f exactly."""
    plain = _grads(_trainer({}))
    zero = _grads(_trainer({**MTP2, "mtp_loss_scaling_factor": 0.0}))
    for name, g in plain.items():
        assert (zero[name] == g).all() or abs(zero[name] - g).max() <= 1e-7 * abs(g).max(), name
    mtp_names = [n for n in zero if n.startswith("mtp.")]
    assert mtp_names and all(not zero[n].any() for n in mtp_names)
    half = _grads(_trainer(MTP2))
    full = _grads(_trainer({**MTP2, "mtp_loss_scaling_factor": 1.0}))
    for n in mtp_names:
        assert abs(full[n] - 2 * half[n]).max() <= 1e-6 * abs(full[n]).max(), n


@pytest.mark.parametrize("model, needle", [
    ({"mtp_num_layers": 15}, "model.mtp_num_layers 15 leaves no token with a target"),
    ({"mtp_num_layers": 0}, "mtp_num_layers"),
    ({"mtp_num_layers": 1, "mtp_loss_scaling_factor": -1}, "mtp_loss_scaling_factor"),
    ({"mtp_num_layers": 1, "packed": True}, "model.mtp_num_layers with training.calculate_per_token_loss"),
    ({"mtp_loss_scaling_factor": 0.3}, "model.mtp_loss_scaling_factor 0.3 is set but model.mtp_num_layers is null"),
])
def test_bad_mtp_fields_are_refused_naming_the_field(model, needle):
    packed = model.pop("packed", False)
    with pytest.raises(ValueError, match=needle) as e:
        parse_spec(tiny_spec(model=model, training={"calculate_per_token_loss": True} if packed else None))
    assert "\n" not in str(e.value)
