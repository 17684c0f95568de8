"""FP8 linears in one process (workers/parallel/fp8.py): the tensorwise linear against the
outside judge, torchao's ``Float8Linear``, bit for bit, emulated and through ``torch._scaled_mm``
(``emulate=False``; workers/parallel/fp8_gemm.py); the blockwise tiles of a TP
shard are the full tensor's; delayed scaling's history; the spec's refusals. The layouts
against the single process: test_fp8_parity.py."""

import pytest
import torch
from torch import nn

from service.spec.spec import parse_spec
from workers.parallel.fp8 import E4M3, E5M2, Fp8Recipe, LinearFp8, amax_to_scale, blockwise_qdq
from workers.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def _torchao(w: torch.Tensor, fmt: str, dtype: torch.dtype, emulate: bool = True) -> nn.Module:
    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import CastConfig

    ref = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    ref[0].weight.data.copy_(w)
    # torchao's default config is tensorwise with e5m2 output gradients: our hybrid
    grad = {} if fmt == "hybrid" else {"cast_config_grad_output": CastConfig(target_dtype=E4M3)}
    return convert_to_float8_training(ref, config=Float8LinearConfig(emulate=emulate, **grad)).to(dtype)


@pytest.mark.parametrize("gemm", ["emulated", "scaled_mm"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_tensorwise_linear_is_torchaos_float8_linear_bit_for_bit(fmt, dtype, cls, gemm):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=g) * 0.05, torch.randn(5, 3, 32, generator=g)
    grad_out = torch.randn(5, 3, 48, generator=g) * 1e-3
    ours = cls(w, None).to(dtype)
    ours.fp8 = LinearFp8(Fp8Recipe(fp8=fmt, recipe="tensorwise", gemm=gemm), None)
    ref = _torchao(w, fmt, dtype, emulate=gemm == "emulated")
    results = []
    for module, weight in ((ours, ours.weight), (ref, ref[0].weight)):
        xi = x.to(dtype).requires_grad_()
        y = module(xi)
        y.backward(grad_out.to(dtype))
        results.append((y.detach(), xi.grad, weight.grad))
    for what, a, b in zip(("output", "input gradient", "weight gradient"), *results):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), f"{what}: max diff {(a - b).abs().max()}"
    # and FP8 did something: the plain linear differs
    assert not torch.equal(cls(w, None).to(dtype)(x.to(dtype)), results[0][0])


def test_blockwise_tiles_of_a_tp_shard_are_the_full_tensors():
    g = torch.Generator().manual_seed(1)
    act, w = torch.randn(4, 2, 32, generator=g), torch.randn(32, 64, generator=g)
    full_a, full_w = blockwise_qdq(act, E5M2, 8, weight=False), blockwise_qdq(w, E4M3, 8, weight=True)
    for r in range(2):  # column shards (last dim of an activation, rows of a weight) and row shards
        assert torch.equal(blockwise_qdq(act[..., 16 * r:16 * (r + 1)], E5M2, 8, weight=False),
                           full_a[..., 16 * r:16 * (r + 1)])
        assert torch.equal(blockwise_qdq(w[16 * r:16 * (r + 1)], E4M3, 8, weight=True), full_w[16 * r:16 * (r + 1)])
        assert torch.equal(blockwise_qdq(w[:, 32 * r:32 * (r + 1)], E4M3, 8, weight=True), full_w[:, 32 * r:32 * (r + 1)])
    # each 8 x 8 weight block has its own power-of-two scale: a block scaled up 100x leaves the others alone
    w2 = w.clone()
    w2[:8, :8] *= 100
    assert torch.equal(blockwise_qdq(w2, E4M3, 8, weight=True)[8:], full_w[8:])
    scale = 448 / w2[:8, :8].abs().max()
    assert torch.log2(torch.floor(torch.log2(scale)).exp2()) % 1 == 0


def test_delayed_scales_come_from_the_history():
    q = LinearFp8(Fp8Recipe(fp8="hybrid", recipe="delayed", amax_history_len=2, amax_compute_algo="max"), None)
    q.update(torch.tensor([2.0, 4.0, 1e-3]))
    assert torch.equal(q.scales, torch.cat([amax_to_scale(torch.tensor([2.0, 4.0]), E4M3),
                                            amax_to_scale(torch.tensor([1e-3]), E5M2)]))
    q.update(torch.tensor([1.0, 8.0, 0.0]))  # max over 2 iterations; the gradient's 0 is never seen: kept
    assert q.scales.tolist() == [448 / 2.0, 448 / 8.0, amax_to_scale(torch.tensor(1e-3), E5M2).item()]
    q.update(torch.tensor([1.0, 1.0, 0.0]))  # iteration 1's amax has left a history of 2
    assert q.scales[:2].tolist() == [448.0, 448 / 8.0]


BASE = {"model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128}}


def _problems(training: dict, model: dict | None = None, parallel: dict | None = None) -> str:
    spec = {**BASE, "model": {**BASE["model"], **(model or {})}, "parallel": parallel or {},
            "training": training, "resources": {"gpus_per_node": 2}}
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    return str(e.value)


@pytest.mark.parametrize("training, model, parallel, says", [
    ({"fp8": "hybrid", "fp16": True}, None, None, "training.fp8 'hybrid' with training.fp16"),
    ({"fp8_recipe": "blockwise"}, None, None, "training.fp8_recipe is set but training.fp8 is null"),
    ({"first_last_layers_bf16": True}, None, None, "training.first_last_layers_bf16 is set but training.fp8 is null"),
    ({"fp8": "e4m3", "fp8_recipe": "tensorwise", "fp8_amax_history_len": 4}, None, None,
     "training.fp8_amax_history_len applies to fp8_recipe: delayed"),
    ({"fp8": "e4m3", "fp8_recipe": "tensorwise", "fp8_amax_compute_algo": "max"}, None, None,
     "training.fp8_amax_compute_algo applies to fp8_recipe: delayed"),
    ({"fp8": "e4m3", "fp8_block_size": 16}, None, None, "training.fp8_block_size applies to fp8_recipe: blockwise"),
    ({"num_layers_at_end_in_bf16": 2}, None, None, "training.num_layers_at_end_in_bf16 is set but training.fp8 is null"),
    ({"fp8": "e4m3", "num_layers_at_start_in_bf16": 2}, None, None,
     "training.num_layers_at_start_in_bf16 applies with training.first_last_layers_bf16: true"),
    ({"fp8": "e4m3", "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 2},
     None, None, "leaves no layer in FP8"),
    ({"fp8": "hybrid", "fp8_recipe": "blockwise"}, None, None,
     "model.hidden_size 64 is not divisible by training.fp8_block_size 128"),
    ({"fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_block_size": 32}, {"ffn_hidden_size": 96, "num_attention_heads": 2},
     {"tensor_model_parallel_size": 2}, "model.ffn_hidden_size / tensor_model_parallel_size 2 48 is not divisible"),
    ({"fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_block_size": 16}, {"multi_latent_attention": True},
     None, "not supported with model.multi_latent_attention"),
])
def test_the_spec_refuses_what_fp8_cannot_run(training, model, parallel, says):
    message = _problems(training, model, parallel)
    assert says in message
    line = next(p for p in message.split("; training.") if says.split("training.")[-1][:20] in p)
    assert "\n" not in line


def test_the_spec_takes_every_recipe():
    for recipe in ("tensorwise", "delayed", "blockwise"):
        extra = {"fp8_block_size": 16} if recipe == "blockwise" else {}
        parse_spec({**BASE, "training": {"fp8": "hybrid", "fp8_recipe": recipe, "bf16": True, **extra}})


def test_the_plan_costs_the_fp8_gemms_as_they_run():
    """Emulated: the linears' GEMMs moved from the bf16 to the fp32 peak; through ``_scaled_mm``
    (``fp8_gemm: auto`` on an H100, a per-tensor recipe): to the FP8 peak, a saving; blockwise
    under ``auto`` stays emulated."""
    from service.spec import cost
    from service.spec.plan import plan_job

    spec = {"model": {"num_layers": 8, "hidden_size": 2048, "num_attention_heads": 16, "ffn_hidden_size": 5632,
                      "seq_length": 2048},
            "training": {"bf16": True, "global_batch_size": 8, "micro_batch_size": 1},
            "resources": {"gpus_per_node": 8, "gpu_type": "H100"}, "parallel": {"tensor_model_parallel_size": 2}}
    emulated = {"fp8": "hybrid", "fp8_gemm": "emulated"}
    steps = {}
    for name, extra in (("bf16", {}), ("fp8", emulated), ("fp8-first-last", {**emulated, "first_last_layers_bf16": True}),
                        ("scaled_mm", {"fp8": "hybrid", "fp8_recipe": "tensorwise"}),
                        ("blockwise", {"fp8": "hybrid", "fp8_recipe": "blockwise"})):
        parsed = parse_spec({**spec, "training": {**spec["training"], **extra}})
        steps[name] = plan_job(parsed)["cost"]["step_seconds"]
    bf16, fp8, first_last = steps["bf16"], steps["fp8"], steps["fp8-first-last"]
    assert "fp8" not in bf16
    # the linears' GEMMs: 12 b s h^2 L ((1 + g/a) + 1.5 f/h), moved from the bf16 to the fp32 peak
    h, L, b, s = 2048, 8, 8, 2048
    flops = 12 * b * s * h * h * L * (2 + 1.5 * 5632 / h)
    want = flops / 8 * (1 / 67e12 - 1 / 989e12) / cost.EFFICIENCY
    assert fp8["fp8"] == pytest.approx(want, rel=1e-9)
    assert fp8["total"] == pytest.approx(bf16["total"] + want, rel=1e-9)
    assert first_last["fp8"] == pytest.approx(want * 6 / 8, rel=1e-9)
    assert steps["scaled_mm"]["fp8"] == pytest.approx(flops / 8 * (1 / 1979e12 - 1 / 989e12) / cost.EFFICIENCY, rel=1e-9)
    assert steps["scaled_mm"]["total"] < bf16["total"] < fp8["total"]
    assert steps["blockwise"]["fp8"] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("recipe, gemm", [("tensorwise", "emulated"), ("delayed", "emulated"), ("delayed", "scaled_mm")])
def test_full_recompute_reproduces_the_fp8_run(recipe, gemm):
    """A recomputed forward quantises as the first did (tensorwise: the same amax; delayed: the
    same scales, and its amaxes, recorded twice, leave the max unchanged); with ``_scaled_mm``
    the backward GEMMs take the scales the first forward chose."""
    from tests.helpers.parity import job_of, run_trainer, tiny_spec

    training = {"fp8": "hybrid", "fp8_recipe": recipe, "fp8_gemm": gemm}
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    plain = run_trainer(0, 1, job_of(tiny_spec(training=training)), iters=2)["losses"]
    assert run_trainer(0, 1, job_of(tiny_spec(training=training, model=recompute)), iters=2)["losses"] == plain


def test_first_last_layers_bf16_leaves_those_layers_and_the_output_layer_unquantised():
    from tests.helpers.parity import job_of, tiny_spec
    from workers.model.decoder import ModelChunk, ShardContext

    job = job_of(tiny_spec(training={"fp8": "hybrid", "first_last_layers_bf16": True,
                                     "num_layers_at_end_in_bf16": 2}))
    chunk = ModelChunk(job.model, ShardContext(fp8=Fp8Recipe.of(job.training)), [0, 1, 2, 3], pre_process=True,
                       post_process=True, positions=torch.arange(job.model.seq_length))
    quantised = sorted(m.fp8.name for m in chunk.modules() if getattr(m, "fp8", None) is not None)
    assert quantised == ["layers.1.attention.proj", "layers.1.attention.qkv", "layers.1.mlp.down", "layers.1.mlp.gate_up"]


def test_a_resumed_delayed_run_scales_from_the_saved_history(tmp_path):
    """The amax history and scales are checkpointed: a run resumed at iteration 3 goes on with
    the same scales, so its losses and gradient norms are the uninterrupted run's, bit for bit
    (mutation: no history in the checkpoint -> the resumed iteration scales as tensorwise)."""
    from tests.helpers.parity import job_of, tiny_spec
    from workers.checkpoint.checkpointer import Checkpointer
    from workers.checkpoint.reader import load_checkpoint
    from workers.parallel.fp8 import delayed_quantizers
    from workers.train.trainer import Trainer

    training = {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history_len": 4, "fp8_amax_compute_algo": "max",
                "eval_interval": None, "train_iters": 6}

    def trainer():
        return Trainer(job_of(tiny_spec(model={"num_layers": 2}, training=training)), 0, 1)

    t = trainer()
    for _ in range(3):
        t.train_step()
    Checkpointer(str(tmp_path)).save(t)
    want = [t.train_step() for _ in range(3)]
    fresh = trainer()
    load_checkpoint(fresh, str(tmp_path))
    saved = {q.name: q.history for q in delayed_quantizers(t.chunks)}
    assert saved and all(q.updated and q.history[3].abs().sum() == 0 for q in delayed_quantizers(fresh.chunks))
    got = [fresh.train_step() for _ in range(3)]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in got] == [m[key] for m in want], key
