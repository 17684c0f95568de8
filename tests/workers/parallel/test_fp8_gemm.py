"""The FP8 GEMMs through ``torch._scaled_mm`` (workers/parallel/fp8_gemm.py) against the emulated
ones: bit for bit where the quantisation is exact (power-of-two scales, integer products), within
the rounding the module docstring names elsewhere; ``auto``'s choice; the spec's refusals; one
layout (tp2 with SP) against the single process. torchao's ``Float8Linear`` with
``emulate=False`` judges the scaled_mm linear bit for bit in test_fp8.py; tests/test_gpu.py runs
:func:`assert_scaled_mm_is_emulated_on_exact_operands` on CUDA."""

import pytest
import torch

from service.spec.spec import parse_spec
from workers.parallel.fp8 import E4M3, Fp8Recipe, LinearFp8, amax_to_scale, dequantize, gemm_mode, quantize
from workers.parallel.fp8 import update_delayed_scales
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def _operands(exact: bool, grad_dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """A weight ``[48, 32]``, an input ``[8, 2, 32]`` and an output gradient ``[8, 2, 48]`` (16
    tokens: every dim a multiple of 16). ``exact``: integers scaled so each amax is 7 / 2^k and
    every scale a power of two (e4m3 448 / 7 = 64, e5m2 57344 / 7 = 8192), each its own, so a
    scale used for the wrong operand shows; the FP8 casts, the products and the sums are exact."""
    g = torch.Generator().manual_seed(0)
    if not exact:
        return (torch.randn(48, 32, generator=g) * 0.05, torch.randn(8, 2, 32, generator=g),
                torch.randn(8, 2, 48, generator=g) * 1e-3)
    out = []
    for shape, unit in (((48, 32), 0.5), ((8, 2, 32), 1.0), ((8, 2, 48), 4.0 if grad_dtype == E4M3 else 0.25)):
        t = torch.randint(-7, 8, shape, generator=g).float()
        t.view(-1)[0] = 7  # the amax
        out.append(t * unit)
    return tuple(t.to(device) for t in out)


def linear_runs(cls, fp8: str, recipe: str, dtype: torch.dtype, exact: bool, device="cpu") -> dict:
    """``{gemm: [(output, input gradient, weight gradient)] per iteration}``: two iterations
    (delayed: the second scales from the first's amax history) of one linear, emulated and
    through ``_scaled_mm``."""
    r = Fp8Recipe(fp8=fp8, recipe=recipe)
    w, x, dy = _operands(exact, r.grad_dtype, device)
    runs = {}
    for gemm in ("emulated", "scaled_mm"):
        layer = cls(w, None).to(device=device, dtype=dtype)
        layer.fp8 = LinearFp8(Fp8Recipe(fp8=fp8, recipe=recipe, gemm=gemm), None)
        runs[gemm] = []
        for it in range(2):
            xi = (x * (it + 1)).to(dtype).requires_grad_()
            layer.weight.grad = None
            y = layer(xi)
            y.backward(dy.to(dtype))
            runs[gemm].append((y.detach(), xi.grad, layer.weight.grad))
            update_delayed_scales([layer], None)
    return runs


def assert_scaled_mm_is_emulated_on_exact_operands(device="cpu") -> None:
    """Every recipe and format, fp32 and bf16, column and row linear: bit for bit."""
    for cls in (ColumnParallelLinear, RowParallelLinear):
        for fp8 in ("hybrid", "e4m3"):
            for recipe in ("tensorwise", "delayed"):
                for dtype in (torch.float32, torch.bfloat16):
                    runs = linear_runs(cls, fp8, recipe, dtype, exact=True, device=device)
                    for it, (emulated, scaled) in enumerate(zip(runs["emulated"], runs["scaled_mm"])):
                        for what, a, b in zip(("output", "input gradient", "weight gradient"), emulated, scaled):
                            assert a.dtype == b.dtype == dtype and torch.equal(a, b), (
                                f"{cls.__name__} {fp8} {recipe} {dtype} iteration {it} {what}: "
                                f"max diff {(a.float() - b.float()).abs().max()}")


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
    w, x, dy = _operands(False, None, "cpu")
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


@pytest.mark.slow
def test_scaled_mm_tp2_sp_matches_the_single_scaled_mm_process():
    """tp2 with SP through ``_scaled_mm`` against the single process's ``_scaled_mm`` run, with
    test_fp8_parity.py's tolerances (its docstring says why TP's are looser)."""
    from tests.helpers.parity import assert_same_curve, check_layout, reference, tiny_spec

    training = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_gemm": "scaled_mm"}
    got = check_layout(tiny_spec(world=2, parallel={"tensor_model_parallel_size": 2, "sequence_parallel": True},
                                 training=training), None, training, loss_rtol=1e-4, grad_rtol=1e-2, norm_rtol=1e-2)[0]
    assert_same_curve(got["losses"][:1], reference(None, training)["losses"][:1])
