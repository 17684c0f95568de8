"""FP8 linears (``training.fp8``, Megatron's): the tensor-parallel linears' three GEMMs
(forward, input gradient, weight gradient) take FP8-quantised operands.

The quantisation, per operand of ``y = x @ W.T``: ``q = saturate(hp.float() * scale)`` cast to
``float8_e4m3fn`` (input and weight; ``hybrid``: ``float8_e5m2`` for the output gradient,
``e4m3``: e4m3 for it too), and the GEMM sees ``q.float() / scale`` and runs in fp32, its
output cast to the compute dtype: torchao's emulated ``Float8Linear`` (``emulate=True``), whose
cast and scale arithmetic these functions repeat to the bit (``tests/workers/parallel/test_fp8.py``
judges by it). The same code runs on gloo/CPU and nccl/GPU; the GEMMs stay the linears' own
(:mod:`workers.parallel.tensor`), so gradient-accumulation fusion's structure, the TP/SP
collectives and a deferred weight gradient are untouched: the layer hands them quantised
operands (:func:`quantize_operands`, a straight-through cast; the weight's copy names its
parameter, ``wgrad_param``, for a zero-bubble ``W``) and quantises the gradient
arriving at its GEMM output (:func:`quantize_grad`). The input gradient and the weight gradient
use the one quantised output gradient, as Transformer Engine and torchao do.

The recipes (``training.fp8_recipe``):

* ``tensorwise``: one scale per tensor per use, ``finfo.max / amax`` (computed in float64,
  stored in fp32, torchao's ``amax_to_scale``). The amax is all-reduced (MAX) over the TP x CP
  group, so a TP shard, an SP or CP sequence shard is quantised with the scale of the whole
  microbatch tensor: the quantisation does not depend on the layout.
* ``delayed``: Megatron's default. The scale of each operand comes from an amax history
  (``fp8_amax_history_len``, ``fp8_amax_compute_algo``: the newest entry or the history's max).
  The first iteration, with no history yet, scales as ``tensorwise`` (Transformer Engine starts
  every scale at 1, which flushes e4m3 gradients of ~1e-4 to zero). The amaxes seen during an iteration (every microbatch, recomputed forwards
  included: a max is idempotent) are reduced once per iteration, over TP x DP x CP, by
  :func:`update_delayed_scales`, so the scale of iteration ``i`` depends only on iterations
  ``< i`` of the global batch, never on how its microbatches were spread over DP ranks. (TE
  updates after every microbatch's forward, which no DP layout could reproduce.)
* ``blockwise`` (DeepSeek-V3's): activations and gradients are scaled per token per
  ``fp8_block_size`` consecutive features (1 x B tiles), weights per B x B block, each scale
  ``finfo.max / amax`` rounded down to a power of two. Tiles never straddle a TP shard (the
  spec checks the dims), and tokens are scaled alone, so no collective is needed. The weight
  gradient GEMM reuses the 1 x B-tiled operands (DeepSeek tiles them B x 1 along the tokens
  there; that tiling would cross SP/CP shards).

The first and last ``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16`` decoder
layers stay in the compute dtype with ``first_last_layers_bf16``; the output layer, the
embedding and the routed experts' grouped GEMMs always do. Master weights and optimizer state
are unchanged (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from workers.parallel import comm

EPS = 1e-12
"""The amax floor of torchao's ``amax_to_scale``."""
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Fp8Recipe:
    """``training.fp8`` and its fields (see the module docstring)."""

    fp8: str = "hybrid"
    recipe: str = "tensorwise"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    block_size: int = 128
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    gemm: str = "emulated"
    """How the GEMMs run: ``emulated`` or ``scaled_mm`` (:mod:`workers.parallel.fp8_gemm`)."""

    @classmethod
    def of(cls, training, device: torch.device | None = None) -> Fp8Recipe | None:
        """The recipe of a :class:`workers.config.TrainingConfig` on ``device`` (None: FP8 off)."""
        if not getattr(training, "fp8", None):
            return None
        return cls(fp8=training.fp8, recipe=training.fp8_recipe, amax_history_len=training.fp8_amax_history_len,
                   amax_compute_algo=training.fp8_amax_compute_algo, block_size=training.fp8_block_size,
                   first_last_layers_bf16=training.first_last_layers_bf16,
                   num_layers_at_start_in_bf16=training.num_layers_at_start_in_bf16,
                   num_layers_at_end_in_bf16=training.num_layers_at_end_in_bf16,
                   gemm=gemm_mode(training.fp8_gemm, training.fp8_recipe, device))

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.fp8 == "hybrid" else E4M3

    def in_fp8(self, index: int, num_layers: int) -> bool:
        """Whether decoder layer ``index`` (global) runs its linears in FP8."""
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 <= index < num_layers - self.num_layers_at_end_in_bf16


def gemm_mode(mode: str, recipe: str, device: torch.device | None) -> str:
    """``training.fp8_gemm`` on ``device``: ``auto`` is ``scaled_mm`` on a CUDA device with FP8
    tensor cores (compute capability 8.9 or newer) for the per-tensor recipes, else ``emulated``."""
    if mode != "auto":
        return mode
    fp8_cores = device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return "scaled_mm" if fp8_cores and recipe != "blockwise" else "emulated"


@dataclass
class ScaledGemm:
    """One ``scaled_mm`` linear call's FP8 state (:mod:`workers.parallel.fp8_gemm`): the input's
    scale, the weight's e4m3 bits and scale, and, once its backward has run, the output
    gradient's FP8 bits and scale."""

    x_scale: torch.Tensor
    w: torch.Tensor
    w_scale: torch.Tensor
    grad: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``finfo(dtype).max / max(amax, EPS)`` in float64, as fp32 (torchao's arithmetic)."""
    return (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


def quantize(hp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 bits of ``hp * scale``, saturated to the format's range."""
    top = torch.finfo(dtype).max
    return (hp.to(torch.float32) * scale).clamp(min=-top, max=top).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the GEMM sees: ``q.float() / scale`` (fp32)."""
    return q.to(torch.float32) / scale


def _block_view(t: torch.Tensor, block: int, weight: bool) -> torch.Tensor:
    """``t`` with every scaling tile on dims the amax reduces over: ``[..., K/B, B]`` for 1 x B
    tiles, ``[O/B, B, K/B, B]`` for a weight's B x B blocks."""
    if weight:
        o, k = t.shape
        return t.reshape(o // block, block, k // block, block)
    return t.reshape(*t.shape[:-1], t.shape[-1] // block, block)


def blockwise_qdq(hp: torch.Tensor, dtype: torch.dtype, block: int, weight: bool) -> torch.Tensor:
    """Quantise-dequantise with power-of-two scales per tile (see the module docstring)."""
    tiles = _block_view(hp.to(torch.float32), block, weight)
    amax = tiles.abs().amax(dim=(1, 3) if weight else -1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax_to_scale(amax, dtype))))
    return dequantize(quantize(tiles, scale, dtype), scale).reshape(hp.shape)


class _Cast(torch.autograd.Function):
    """Forward: the dequantised FP8 operand (fp32); backward: straight through, in ``hp``'s dtype."""

    @staticmethod
    def forward(ctx, hp, dequantized):
        ctx.dtype = hp.dtype
        ctx.set_materialize_grads(False)  # a zero-bubble B defers the weight's GEMM: no gradient yet
        return dequantized

    @staticmethod
    def backward(ctx, grad):
        return None if grad is None else grad.to(ctx.dtype), None


class _GradCast(torch.autograd.Function):
    """Forward: the GEMM output cast to the compute dtype; backward: the output gradient quantised."""

    @staticmethod
    def forward(ctx, y, quantizer, dtype, gemm):
        ctx.quantizer, ctx.gemm = quantizer, gemm
        return y.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.gemm is None:
            return ctx.quantizer.qdq_grad(grad), None, None, None
        # scaled_mm: both backward GEMMs take the FP8 gradient from ctx.gemm
        ctx.gemm.grad = ctx.quantizer.quantized([grad], ctx.quantizer.recipe.grad_dtype, slice(2, 3))[0]
        return grad, None, None, None


class LinearFp8:
    """One linear's quantiser: the recipe, the group its amax is reduced over (TP x CP) and,
    for ``delayed``, its scales, amax history and the amaxes seen since the last update,
    ordered (input, weight, output gradient)."""

    def __init__(self, recipe: Fp8Recipe, group, name: str = ""):
        self.recipe, self.group, self.name = recipe, group, name
        if recipe.recipe == "delayed":
            self.scales = torch.ones(3)
            self.history = torch.zeros(recipe.amax_history_len, 3)
            self.seen = torch.zeros(3)
            self.updated = False  # no history yet: the first iteration scales as tensorwise

    def _scales(self, tensors, dtype: torch.dtype, roles: slice) -> list[torch.Tensor]:
        amax = torch.stack([t.detach().abs().amax().to(torch.float32) for t in tensors])
        if self.recipe.recipe == "delayed":
            if torch.is_grad_enabled() or roles.start == 2:  # an evaluation forward leaves no trace
                self.seen = self.seen.to(amax.device)
                self.seen[roles] = torch.maximum(self.seen[roles], amax)
            if self.updated:
                self.scales = self.scales.to(amax.device)
                return list(self.scales[roles])
        if comm.world_size(self.group) > 1:
            comm.all_reduce(amax, self.group, op=dist.ReduceOp.MAX)
        return list(amax_to_scale(amax, dtype))

    def quantized(self, tensors, dtype: torch.dtype, roles: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each tensor's FP8 bits and scale (the per-tensor recipes)."""
        return [(quantize(t, s, dtype), s) for t, s in zip(tensors, self._scales(tensors, dtype, roles))]

    def qdq(self, tensors, dtype: torch.dtype, roles: slice, weights: tuple[bool, ...]) -> list[torch.Tensor]:
        if self.recipe.recipe == "blockwise":
            return [blockwise_qdq(t, dtype, self.recipe.block_size, w) for t, w in zip(tensors, weights)]
        return [dequantize(q, s) for q, s in self.quantized(tensors, dtype, roles)]

    def qdq_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return self.qdq([grad], self.recipe.grad_dtype, slice(2, 3), (False,))[0]

    def update(self, amax: torch.Tensor) -> None:
        """Delayed scaling: push this iteration's reduced amaxes and recompute the scales
        (an operand never seen keeps its scale, as Transformer Engine)."""
        self.history = torch.roll(self.history.to(amax.device), 1, dims=0)
        self.history[0] = amax
        best = self.history[0] if self.recipe.amax_compute_algo == "most_recent" else self.history.amax(dim=0)
        fresh = torch.cat([amax_to_scale(best[:2], E4M3), amax_to_scale(best[2:], self.recipe.grad_dtype)])
        self.scales = torch.where(best > 0, fresh, self.scales.to(amax.device))
        self.seen = torch.zeros_like(self.seen, device=amax.device)
        self.updated = True


def quantize_operands(layer, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s GEMM operands: as given, or (``layer.fp8`` set) their FP8 quantisation."""
    q: LinearFp8 | None = getattr(layer, "fp8", None)
    if q is None:
        return x, weight
    if q.recipe.gemm == "scaled_mm":  # the operands as given; the GEMMs cast them (workers.parallel.fp8_gemm)
        x_scale, w_scale = q._scales([x, weight], E4M3, slice(0, 2))
        wq = _Cast.apply(weight, weight)
        wq.fp8_gemm = ScaledGemm(x_scale, quantize(weight, w_scale, E4M3), w_scale)
    else:
        xq, wq = q.qdq([x, weight], E4M3, slice(0, 2), (False, True))
        wq, x = _Cast.apply(weight, wq), _Cast.apply(x, xq)
    wq.wgrad_param = weight  # whose gradient a deferred weight-gradient GEMM is (workers.parallel.wgrad)
    return x, wq


def quantize_grad(layer, y: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor) -> torch.Tensor:
    """``layer``'s GEMM output ``y`` (of the operand ``weight`` :func:`quantize_operands` gave) in
    the compute ``dtype``; with FP8 its gradient is quantised."""
    q: LinearFp8 | None = getattr(layer, "fp8", None)
    return y if q is None else _GradCast.apply(y, q, dtype, getattr(weight, "fp8_gemm", None))


def attach_fp8(layers, recipe: Fp8Recipe | None, group, num_layers: int, kinds: tuple[type, ...]) -> None:
    """Give every linear of the decoder ``layers`` (modules of ``kinds``: the tensor-parallel
    linears) that runs in FP8 its quantiser."""
    if recipe is None:
        return
    for layer in layers:
        if recipe.in_fp8(layer.index, num_layers):
            for name, module in layer.named_modules():
                if isinstance(module, kinds):
                    module.fp8 = LinearFp8(recipe, group, f"layers.{layer.index}.{name}")


def delayed_quantizers(chunks) -> list[LinearFp8]:
    """This rank's delayed-scaling quantisers, in module order."""
    return [m.fp8 for chunk in chunks for m in chunk.modules()
            if isinstance(getattr(m, "fp8", None), LinearFp8) and m.fp8.recipe.recipe == "delayed"]


def delayed_state(chunks) -> list[tuple[str, torch.Tensor]]:
    """What a checkpoint keeps of delayed scaling, by the linear's logical name: its amax
    history ``[fp8_amax_history_len, 3]`` and scales ``[3]`` (input, weight, output gradient).
    Both are reduced over every rank holding the linear, so any layout reads them back."""
    return [(f"{q.name}.{key}", getattr(q, attr)) for q in delayed_quantizers(chunks)
            for key, attr in (("fp8_amax_history", "history"), ("fp8_scales", "scales"))]


def delayed_state_loaded(chunks) -> None:
    """After a checkpoint filled the histories: a linear with a history scales from it (the
    iterations before the save had updated it), one without starts as tensorwise."""
    for q in delayed_quantizers(chunks):
        q.updated = bool(q.history.abs().sum() > 0)


def update_delayed_scales(chunks, group) -> None:
    """Delayed scaling, once per iteration after the backwards: the amaxes this rank's
    linears saw, reduced (MAX) over ``group`` (the stage's TP x DP x CP ranks), in one
    collective, then each linear's history and scales."""
    quantizers = delayed_quantizers(chunks)
    if not quantizers:
        return
    amax = torch.stack([q.seen for q in quantizers])
    if comm.world_size(group) > 1:
        comm.all_reduce(amax, group, op=dist.ReduceOp.MAX)
    for q, row in zip(quantizers, amax):
        q.update(row)
