"""The FP8 GEMMs through ``torch._scaled_mm`` (workers/parallel/fp8_gemm.py) against the emulated
ones: bit for bit where the quantisation is exact (power-of-two scales, integer products), within
the rounding the module docstring names elsewhere; ``auto``'s choice; the spec's refusals (the
layouts against the single process: test_fp8_parity.py's ``*-scaled_mm`` recipes). torchao's ``Float8Linear`` with
``emulate=False`` judges the scaled_mm linear bit for bit in test_fp8.py; tests/test_gpu.py runs
the exact-operand check on CUDA (tests/helpers/fp8.py)."""

import pytest
import torch

from service.spec.spec import parse_spec
from tests.helpers.fp8 import assert_scaled_mm_is_emulated_on_exact_operands, linear_runs, operands
from workers.parallel.fp8 import E4M3, amax_to_scale, dequantize, gemm_mode, quantize
from workers.parallel.tensor import ColumnParallelLinear


def test_scaled_mm_is_the_emulated_gemm_bit_for_bit_on_exact_operands():
    """The forward, input-gradient and weight-gradient GEMMs get the emulated path's FP8 bits and
    scales (mutations: the input's scale for the weight's, the weight not transposed for the
    input gradient, e4m3 output gradients in hybrid -> not equal)."""
    assert_scaled_mm_is_emulated_on_exact_operands()


def test_scaled_mm_differs_from_the_emulated_gemm_by_its_rounding_only():
    """Random operands: the emulated GEMM sums ``(qa / sa)(qb / sb)``, each factor rounded to
    fp32, ``_scaled_mm`` the exact ``qa qb``, then scales by ``(1/sa)(1/sb)``; both sum K terms in
    fp32 in their own order. Each element is within ``(2K + 8) 2^-24 sum |a||b|`` of the other,
    over the dequantised operands (tensorwise, fp32, one linear: the operands are known here)."""
    runs = linear_runs(ColumnParallelLinear, "hybrid", "tensorwise", torch.float32, exact=False)
    w, x, dy = operands(False, None, "cpu")
    xd, wd, gd = (dequantize(quantize(t, s, f), s) for t, f in ((x, E4M3), (w, E4M3), (dy, torch.float8_e5m2))
                  for s in [amax_to_scale(t.abs().amax(), f)])
    xd, gd = xd.reshape(-1, 32), gd.reshape(-1, 48)
    bounds = (xd.abs() @ wd.abs().t(), gd.abs() @ wd.abs(), gd.abs().t() @ xd.abs())
    for what, a, b, terms in zip(("output", "input gradient", "weight gradient"), runs["emulated"][0],
                                 runs["scaled_mm"][0], bounds):
        k = {"output": 32, "input gradient": 48, "weight gradient": 16}[what]
        diff = (a - b).reshape(terms.shape).abs()
        assert (diff <= (2 * k + 8) * 2.0**-24 * terms).all(), f"{what}: {(diff / terms).max()}"


def test_auto_runs_scaled_mm_where_fp8_tensor_cores_are():
    assert gemm_mode("auto", "tensorwise", torch.device("cpu")) == "emulated"
    assert gemm_mode("auto", "delayed", None) == "emulated"
    assert gemm_mode("scaled_mm", "delayed", torch.device("cpu")) == "scaled_mm"
    assert gemm_mode("emulated", "tensorwise", torch.device("cpu")) == "emulated"


BASE = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
                  "seq_length": 64}, "training": {"fp8": "hybrid", "fp8_recipe": "tensorwise", "micro_batch_size": 2}}


@pytest.mark.parametrize("training, model, resources, says", [
    ({"fp8": None, "fp8_recipe": "delayed", "fp8_gemm": "scaled_mm"}, {}, {},
     "training.fp8_gemm is set but training.fp8 is null"),
    ({"fp8_recipe": "blockwise", "fp8_block_size": 16, "fp8_gemm": "scaled_mm"}, {}, {},
     "training.fp8_gemm scaled_mm takes per-tensor scales, not fp8_recipe blockwise's tiles"),
    ({"fp8_gemm": "scaled_mm"}, {}, {"gpu_type": "A100"}, "needs FP8 tensor cores (H100, H200, B200), not"),
    ({}, {"ffn_hidden_size": 72}, {"gpu_type": "H100"},
     "model.ffn_hidden_size / tensor_model_parallel_size 1 is 72; make it a multiple of 16"),
    ({"fp8_gemm": "scaled_mm"}, {"seq_length": 36}, {"gpu_type": "H200"},
     "training.micro_batch_size x model.seq_length / context_parallel_size 1 (tokens) is 72"),
])
def test_the_spec_refuses_scaled_mm_where_it_cannot_run(training, model, resources, says):
    spec = {"model": {**BASE["model"], **model}, "training": {**BASE["training"], **training}, "resources": resources}
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    line = next(p for p in str(e.value).split("; training.") if says.split("training.")[-1][:30] in p)
    assert says in str(e.value) and "\n" not in line


def test_the_spec_takes_scaled_mm_on_cpu_and_emulated_anywhere():
    parse_spec({"model": {**BASE["model"], "ffn_hidden_size": 72}, "training": {**BASE["training"], "fp8_gemm": "scaled_mm"}})
    parse_spec({"model": {**BASE["model"], "ffn_hidden_size": 72}, "resources": {"gpu_type": "H100"},
                "training": {**BASE["training"], "fp8_gemm": "emulated"}})
    parse_spec({**BASE, "resources": {"gpu_type": "H100"}})
