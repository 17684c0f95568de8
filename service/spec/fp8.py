"""The FP8 fields' cross-field rules (``training.fp8`` and friends, :mod:`workers.parallel.fp8`),
each problem one line naming the fields, the numbers and the fix."""

from __future__ import annotations

_DELAYED_ONLY = ("fp8_amax_history_len", "fp8_amax_compute_algo")
_LAYER_COUNTS = ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
_WITH_FP8 = ("fp8_recipe", "first_last_layers_bf16", "fp8_block_size", "fp8_gemm", *_DELAYED_ONLY, *_LAYER_COUNTS)
FP8_GPUS = ("H100", "H200", "B200")
"""The ``resources.gpu_type`` values with FP8 tensor cores (``fp8_gemm: auto`` runs ``_scaled_mm`` there)."""


def fp8_problems(m, p, t, gpu_type: str | None = None) -> list[str]:
    """Problems of the FP8 fields of a spec's model ``m``, parallel ``p`` and training ``t`` on
    ``resources.gpu_type``."""
    given = {f for f in _WITH_FP8 if getattr(t, f) != type(t).model_fields[f].default}  # set to a non-default value
    if not t.fp8:
        return [f"training.{f} is set but training.fp8 is null; set fp8: e4m3 or hybrid, or drop {f}"
                for f in _WITH_FP8 if f in given]
    out = []
    if t.fp16:
        out.append(f"training.fp8 {t.fp8!r} with training.fp16: FP8 GEMMs take bf16 (or fp32) operands and no "
                   f"loss scale; use bf16: true instead of fp16, or drop fp8")
    out += [f"training.{f} applies to fp8_recipe: delayed, not {t.fp8_recipe!r}; drop {f} or use the delayed recipe"
            for f in _DELAYED_ONLY if f in given and t.fp8_recipe != "delayed"]
    if "fp8_block_size" in given and t.fp8_recipe != "blockwise":
        out.append(f"training.fp8_block_size applies to fp8_recipe: blockwise, not {t.fp8_recipe!r}; "
                   f"drop fp8_block_size or use the blockwise recipe")
    out += [f"training.{f} applies with training.first_last_layers_bf16: true; set it, or drop {f}"
            for f in _LAYER_COUNTS if f in given and not t.first_last_layers_bf16]
    if t.first_last_layers_bf16 and t.num_layers_at_start_in_bf16 + t.num_layers_at_end_in_bf16 >= m.num_layers:
        out.append(f"training.first_last_layers_bf16 with num_layers_at_start_in_bf16 {t.num_layers_at_start_in_bf16}"
                   f" + num_layers_at_end_in_bf16 {t.num_layers_at_end_in_bf16} >= model.num_layers {m.num_layers} "
                   f"leaves no layer in FP8; keep fewer layers in bf16, or drop fp8")
    if t.fp8_recipe == "blockwise":
        out += _block_problems(m, p, t.fp8_block_size)
    return out + _gemm_problems(m, p, t, gpu_type)


def _gemm_problems(m, p, t, gpu_type: str | None) -> list[str]:
    """``fp8_gemm: scaled_mm`` needs a per-tensor recipe and, on a GPU, FP8 tensor cores and
    every GEMM dim a multiple of 16 (cuBLASLt's rule): features per TP shard and tokens."""
    if t.fp8_gemm == "scaled_mm" and t.fp8_recipe == "blockwise":
        return ["training.fp8_gemm scaled_mm takes per-tensor scales, not fp8_recipe blockwise's tiles; use "
                "fp8_recipe tensorwise or delayed, or fp8_gemm: emulated (or auto)"]
    if gpu_type in (None, "cpu") or t.fp8_gemm == "emulated" or t.fp8_recipe == "blockwise":
        return []
    if gpu_type not in FP8_GPUS:
        return [f"training.fp8_gemm scaled_mm needs FP8 tensor cores ({', '.join(FP8_GPUS)}), not resources.gpu_type "
                f"{gpu_type}; use fp8_gemm: emulated (or auto)"] if t.fp8_gemm == "scaled_mm" else []
    if m.multi_latent_attention:
        return [f"training.fp8_gemm {t.fp8_gemm} on {gpu_type} runs _scaled_mm, whose dims model.multi_latent_attention's"
                f" projections are not checked against; use fp8_gemm: emulated"]
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    dims = {"model.hidden_size": m.hidden_size,
            f"model.num_attention_heads x kv_channels / tensor_model_parallel_size {tp}": m.num_attention_heads * kv // tp,
            f"model.num_query_groups x kv_channels / tensor_model_parallel_size {tp}":
                (m.num_query_groups or m.num_attention_heads) * kv // tp,
            f"model.ffn_hidden_size / tensor_model_parallel_size {tp}": (m.ffn_hidden_size or 4 * m.hidden_size) // tp}
    if isinstance(t.micro_batch_size, int):
        dims[f"training.micro_batch_size x model.seq_length / context_parallel_size {cp} (tokens)"] = \
            t.micro_batch_size * m.seq_length // cp
    return [f"training.fp8_gemm {t.fp8_gemm} on {gpu_type} runs _scaled_mm, whose dims must be multiples of 16: "
            f"{name} is {size}; make it a multiple of 16, or use fp8_gemm: emulated" for name, size in dims.items()
            if size % 16]


def _block_problems(m, p, block: int) -> list[str]:
    """Blockwise tiles must not straddle a TP shard or a fused projection's parts."""
    if m.multi_latent_attention:
        return [f"training.fp8_recipe blockwise is not supported with model.multi_latent_attention (its low-rank "
                f"projections' dims are not checked against fp8_block_size {block}); use tensorwise or delayed"]
    tp = p.tensor_model_parallel_size
    heads = m.num_attention_heads
    dims = {"model.hidden_size": m.hidden_size,
            "model.kv_channels (the head dim)": m.kv_channels or m.hidden_size // heads,
            f"model.ffn_hidden_size / tensor_model_parallel_size {tp}": (m.ffn_hidden_size or 4 * m.hidden_size) // tp}
    if m.moe_shared_expert_intermediate_size:
        dims[f"model.moe_shared_expert_intermediate_size / tensor_model_parallel_size {tp}"] = \
            m.moe_shared_expert_intermediate_size // tp
    return [f"training.fp8_recipe blockwise: {name} {size} is not divisible by training.fp8_block_size {block}; "
            f"choose a block that divides it, or tensorwise/delayed" for name, size in dims.items() if size % block]


# -- the plan's cost of the FP8 linears (service.spec.plan) ----------------------------------------
FP32_TFLOPS = {"A100": 19.5, "H100": 67.0, "H200": 67.0, "B200": 80.0}
"""Dense fp32 (non-tensor-core) peaks, the datasheets beside service.spec.cluster_figures.GPU_FIGURES's bf16."""
FP8_TFLOPS = {"H100": 1979.0, "H200": 1979.0, "B200": 4500.0}
"""Dense FP8 tensor-core peaks (2x bf16), what the ``torch._scaled_mm`` GEMMs run at."""


def runs_scaled_mm(t, gpu_type: str | None) -> bool:
    """Whether the FP8 linears' GEMMs run ``torch._scaled_mm`` on ``gpu_type``: ``fp8_gemm``
    ``scaled_mm``, or ``auto`` on FP8 tensor cores, with a per-tensor recipe (the workers' choice,
    :func:`workers.parallel.fp8.gemm_mode`, on that device)."""
    if t.fp8_recipe == "blockwise" or t.fp8_gemm == "emulated":
        return False
    return t.fp8_gemm == "scaled_mm" or gpu_type in FP8_GPUS


def fp8_linear_flops(s, batch: int, t) -> float:
    """Megatron's FLOPs (``num_floating_point_operations``'s terms) of the GEMMs that run in FP8:
    QKV and output projection, and the dense MLP or the shared experts, of every FP8 layer. MLA's
    projections are not counted (0 for an MLA model)."""
    if not t.fp8 or s.mla:
        return 0.0
    layers = [i for i in range(s.layers) if not t.first_last_layers_bf16
              or t.num_layers_at_start_in_bf16 <= i < s.layers - t.num_layers_at_end_in_bf16]
    h = s.hidden
    attention = (1 + s.groups / s.heads) * (s.heads * s.head_dim / h)
    mlp = sum(((s.shared_ffn or 0) if s.experts and s.is_moe_layer(i) else s.ffn) for i in layers) * 1.5 / h
    return 12 * batch * s.seq * h * h * (attention * len(layers) + mlp)


def fp8_seconds(s, t, gpu_type: str | None, peak_flops: float, efficiency: float, world: int) -> float:
    """What the FP8 linears add to a step on accelerators (negative: what they save), as the code
    runs them: through ``_scaled_mm`` (:func:`runs_scaled_mm`) those FLOPs go at the FP8 peak
    instead of the bf16 one the step's compute was costed at; emulated, each GEMM in fp32 on
    dequantised operands, at the fp32 peak (an unknown accelerator: H100's fp32 / bf16 ratio).
    Nothing for the elementwise casts (memory-bound, small beside the GEMMs)."""
    flops = fp8_linear_flops(s, t.global_batch_size, t)
    if not flops:
        return 0.0
    if runs_scaled_mm(t, gpu_type):
        fast = FP8_TFLOPS.get(gpu_type, 2 * peak_flops / 1e12) * 1e12
    else:
        fast = FP32_TFLOPS[gpu_type] * 1e12 if gpu_type in FP32_TFLOPS else peak_flops * FP32_TFLOPS["H100"] / 989.0
    return flops / world * (1 / (fast * efficiency) - 1 / (peak_flops * efficiency))
