"""``training.main_grads_dtype: fp64`` (workers/parallel/data.py, wgrad.py): a dp2 run's gradient
sums are exact, so its weights equal the single process's bit for bit where fp32 sums (8
microbatches in a row against two partial sums of 4) leave them a last bit apart; a cp2 run's
gradients and weights equal the single process's bit for bit too (the sums over the tokens CP
cuts and the attention in float64); both keep the parity job's checks (loss 1e-6, gradients
1e-5); and the plan counts its bytes."""

import numpy as np
import pytest

from tests.helpers.parity import assemble, check_layout, distributed_run, reference, tiny_spec


def differing(got: dict, want: dict) -> list[str]:
    return [name for name, w in want.items() if not np.array_equal(got[name][tuple(slice(0, n) for n in w.shape)], w)]


@pytest.mark.slow
def test_fp64_main_grads_make_dp2_weights_bit_identical_to_the_single_process():
    fp64 = {"main_grads_dtype": "fp64"}
    per_rank = check_layout(tiny_spec(world=2, training=fp64), None, fp64)
    assert differing(per_rank[0]["params"], reference(None, fp64)["params"]) == []
    # The contrast: fp32 sums in another order leave some weight a last bit apart.
    assert differing(distributed_run(tiny_spec(world=2))[0]["params"], reference()["params"])


@pytest.mark.slow
def test_fp64_main_grads_make_cp2_weights_bit_identical_to_the_single_process():
    """CP cuts the tokens: the norms' (qk norms too), the embedding's and the QKV bias's
    gradients (sums over the tokens outside any GEMM, added in float64 into the buffer) and the
    ring attention (in float64, as the single process's, rounded once) leave every iteration-0
    gradient and every weight after the last step bit-equal to the single process's."""
    fp64, qwen = {"main_grads_dtype": "fp64"}, {"add_qkv_bias": True, "qk_layernorm": True}
    per_rank = check_layout(tiny_spec(world=2, parallel={"context_parallel_size": 2}, training=fp64, model=qwen),
                            qwen, fp64)
    ref = reference(qwen, fp64)
    assert differing(assemble(per_rank, "grads"), ref["grads"]) == []
    assert differing(assemble(per_rank, "params"), ref["params"]) == []


def test_the_plan_counts_8_bytes_per_fp64_grad_element_and_twice_the_dp_traffic():
    from service.spec.plan import plan_job
    from service.spec.spec import parse_spec

    plans = [plan_job(parse_spec(tiny_spec(world=2, training={"main_grads_dtype": d}))) for d in ("fp32", "fp64")]
    (m32, m64), (t32, t64) = ([p["memory"][0] for p in plans]), ([p["traffic"]["dp"] for p in plans])
    assert m64["grad_bytes"] == 8 * m64["parameters"] == 2 * m32["grad_bytes"]
    assert m64["total_bytes"] - m32["total_bytes"] == m32["grad_bytes"]
    assert sum(t64.values()) == 2 * sum(t32.values()) > 0
    state = [p["cost"]["state_bytes"]["gradients"] for p in plans]
    assert state[1] == 2 * state[0]
