"""Layout invariance of the Qwen2/Qwen3 attention variants (see parity.py): one model with a QKV
bias, RMSNorm on each q and k head, a head dimension apart from hidden / heads (kv_channels) and
the output layer tied to the embedding, over TP (with and without SP), PP with VPP, PP x DP
with the distributed optimizer, and CP. With pp > 1 the tied weight lives on the first and the
last stage: the gradient check compares both copies' reduced gradient with the single
process's, and the replica check holds the two copies bit-equal after every update."""

import pytest

from tests.helpers.parity import check_layout, tiny_spec

pytestmark = pytest.mark.slow

QWEN = {"add_qkv_bias": True, "qk_layernorm": True, "kv_channels": 16, "untie_embeddings_and_output_weights": False}

LAYOUTS = {
    # name: (world, parallel)
    # Without SP the q/k norms' grads are still partial over TP (each rank normalises its heads).
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "pp2-dp2-distopt": (4, {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True}),
    "cp2": (2, {"context_parallel_size": 2}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qwen_attention_layout_matches_single_process(name):
    world, parallel = LAYOUTS[name]
    # Gradients at 2e-6, not 1e-6: the q/k norm weights' gradients ([head_dim]) are each a sum over
    # every token of every head, summed in another order across TP/CP ranks (measured 1.24e-6 on
    # k_norm; every other gradient and the norms hold 1e-6).
    check_layout(tiny_spec(world=world, parallel=parallel, model=QWEN), QWEN, grad_rtol=2e-6, norm_rtol=1e-6)


def test_bf16_tied_across_pp_with_the_distributed_optimizer():
    """bf16 (fp32 main grads: the tied copy's grads are summed in fp32) agrees with the single
    bf16 process within what bf16 allows (test_mixed_precision's tolerances)."""
    from tests.helpers.layouts import BF16, BF16_TOL

    world, parallel = LAYOUTS["pp2-dp2-distopt"]
    check_layout(tiny_spec(world=world, parallel=parallel, model=QWEN, training=BF16), QWEN, BF16, **BF16_TOL)


def test_tied_checkpoint_across_pp_is_stored_once_and_reshards(tmp_path):
    """pp2 with the distributed optimizer saves the tied embedding (held by the first and the
    last stage, weights and moments) once; tp2 x sp then loads it and goes on along the
    uninterrupted curve."""
    import json

    from tests.helpers.parity import assert_same_curve
    from tests.helpers.checkpoints import RTOL, assert_written_once, reference, run

    ref = reference(json.dumps(QWEN))
    saved = run(2, {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True}, QWEN,
                save_root=str(tmp_path), save_at=(2,), until=2)
    assert_same_curve(saved[0]["losses"], ref[:2], rtol=RTOL)
    assert_written_once(tmp_path / "iter_0000002")
    out = run(2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, QWEN, load=str(tmp_path))
    assert out[0]["start"] == 2
    assert_same_curve(out[0]["losses"], ref[2:], rtol=RTOL)
