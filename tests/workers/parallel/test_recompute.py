"""Activation recomputation equals no recomputation (Megatron's full uniform/block and
selective), in one process and across layouts whose recomputed regions communicate (SP
all-gathers, CP ring, MoE all-to-all), and it does save activations."""

import numpy as np
import pytest

from tests.helpers.layouts import light
from tests.helpers.parity import check_layout, job_of, metric, reference, run_trainer, tiny_spec

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01}
SETTINGS = {
    "full-uniform-1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full-uniform-3": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 3},
    "full-block-2": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    "selective": {"recompute_granularity": "selective"},
}


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_single_process_recompute_is_bit_equal(name, moe):
    base = MOE if moe else {}
    ref = reference(base or None)
    got = run_trainer(0, 1, job_of(tiny_spec(model={**base, **SETTINGS[name]})))
    assert got["losses"] == ref["losses"] and got["aux"] == ref["aux"]
    assert metric(got, "grad_norm") == metric(ref, "grad_norm")
    for key in ("grads", "params"):
        for param, want in ref[key].items():
            assert np.array_equal(got[key][param], want), f"{key} of {param} differ with {name}"


LAYOUTS = {
    # SP all-gathers and CP ring exchanges rerun inside every recomputed layer.
    "tp2-sp-cp2-full-uniform-1": (False, 4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                             "context_parallel_size": 2}, "full-uniform-1"),
    # block: the first layer of each pipeline model chunk.
    "pp2-vpp2-full-block-1": (False, 2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
                              {"recompute_granularity": "full", "recompute_method": "block",
                               "recompute_num_layers": 1}),
    # MoE all-to-all and the aux loss (recorded once, not per recompute) inside the region.
    "moe-tp2-sp-ep2-full-uniform-1": (True, 4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                                "expert_model_parallel_size": 2}, "full-uniform-1"),
    "cp2-p2p-selective": (False, 2, {"context_parallel_size": 2}, "selective"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recompute_layout_matches_single_process_without_recompute(name):
    moe, world, parallel, setting = LAYOUTS[name]
    setting = SETTINGS[setting] if isinstance(setting, str) else setting
    model, training = light(parallel, setting)
    check_layout(tiny_spec(moe=moe, world=world, parallel=parallel, model=model, training=training),
                 {**(MOE if moe else {}), **model}, training)


def test_recompute_saves_activations():
    from bench.recompute_bench import measure

    small = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 4,
             "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 64}
    none = measure("none", iters=1, model=small)["saved"]
    full = measure("full-uniform-1", iters=1, model=small)["saved"]
    block = measure("full-block-2", iters=1, model=small)["saved"]  # both layers of the chunk
    pair = measure("full-uniform-2", iters=1, model=small)["saved"]  # one group: one input kept
    assert full < 0.5 * none and block == full and pair < full


@pytest.mark.parametrize("model, words", [
    ({"recompute_granularity": "full"}, ["recompute_method", "recompute_num_layers"]),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 5}, ["between 1 and", "(4)"]),
    ({"recompute_granularity": "selective", "recompute_num_layers": 1}, ["recompute_num_layers", "full"]),
    ({"recompute_method": "uniform"}, ["recompute_granularity"]),
])
def test_recompute_fields_are_checked(model, words):
    with pytest.raises(ValueError) as e:
        job_of(tiny_spec(model=model))
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("name, layer_runs, core_runs", [
    (None, 4, 4), ("selective", 4, 8), ("full-uniform-1", 8, 8), ("full-uniform-3", 8, 8), ("full-block-2", 6, 6)])
def test_recomputed_regions_run_twice(monkeypatch, name, layer_runs, core_runs):
    """Per microbatch, of 4 layers: which forwards rerun in backward (Megatron's semantics)."""
    from workers.model import layer as model_module
    from workers.train.trainer import Trainer

    calls = {"layer": 0, "core": 0}
    layer_forward, core = model_module.DecoderLayer.forward, model_module.Attention._core

    def count_layer(self, *args):
        calls["layer"] += 1
        return layer_forward(self, *args)

    def count_core(self, *args):
        calls["core"] += 1
        return core(self, *args)

    monkeypatch.setattr(model_module.DecoderLayer, "forward", count_layer)
    monkeypatch.setattr(model_module.Attention, "_core", count_core)
    trainer = Trainer(job_of(tiny_spec(model=SETTINGS[name] if name else None, training={"eval_interval": None})), 0, 1)
    trainer.train_step()
    assert calls == {"layer": layer_runs * trainer.num_microbatches, "core": core_runs * trainer.num_microbatches}
