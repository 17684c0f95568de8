"""Gradient-accumulation fusion (Megatron's ``gradient_accumulation_fusion``).

A linear layer's weight gradient ``grad^T @ x`` is normally a fresh weight-sized tensor that
autograd's AccumulateGrad then adds into ``.grad``, the param's view of the data-parallel
gradient buffer (:mod:`workers.parallel.data`): one allocation and one more pass over the
weight per microbatch. Fused, the weight-gradient GEMM accumulates into the buffer itself
(``main_grad.addmm_(grad^T, x)``, beta 1) and the layer hands autograd a dummy gradient
instead.

The protocol, Megatron's, except that ``.grad`` stays the buffer view outside backward:

* :class:`workers.parallel.data.DataParallelGrads` gives each param it manages a ``main_grad``
  attribute, its view of the flat buffer (removed again by ``remove_hooks``); a param without
  one (a module used on its own) keeps plain autograd.
* A weight with a ``main_grad`` (:func:`grad_owner`) runs its GEMMs through a custom Function
  whose backward calls :func:`weight_grad`; the param is kept on ``ctx``: a weight saved for
  backward inside a recomputed (non-reentrant checkpoint) region comes back detached, without
  its attributes. The fusion applies when ``main_grad`` has the weight's dtype (fp32 training;
  bf16/fp16 keep accumulating a low-precision ``.grad`` into the fp32 buffer in the hook:
  ``addmm_`` cannot mix dtypes, so :func:`weight_grad` returns the GEMM to autograd).
* The fused backward sets ``weight.grad_added_to_main_grad``, sets ``weight.grad`` to None
  (else AccumulateGrad would add the dummy into the buffer view) and returns an uninitialised
  ``torch.empty_like(weight)``, which AccumulateGrad takes as ``.grad`` without a copy, so the
  param's post-accumulate hook still runs, on the main thread, when the weight's gradient is
  final: the hook drops the dummy, puts the buffer view back as ``.grad`` (every reader of
  ``p.grad`` sees what it saw before) and marks the bucket ready, so the overlapped reduction
  goes out exactly when it did.
* A weight used twice in one backward (a tied embedding and output layer on one stage) would
  get the dummy summed with its other gradient: such a param carries ``zero_out_wgrad = True``,
  the dummy is zeros, and the hook adds what ``.grad`` holds (the other uses' gradient).

Zero-bubble pipelines (:mod:`workers.parallel.pipeline_zb`) split a backward into the input
gradient (``B``) and the weight gradient (``W``): a backward run inside
:func:`deferred_wgrads` queues each weight-gradient GEMM (its output gradient and input) and
hands autograd no weight gradient; ``weight.wgrad_deferred`` counts the GEMMs queued and not
yet run, and the data-parallel hook marks no weight final while it is positive;
:func:`run_wgrads` later runs the queued GEMMs and gives autograd each weight's gradient, so the
hooks run then, exactly as in an unsplit backward. In fp32 the GEMMs go into ``main_grad`` and
autograd gets the fused path's dummies. In bf16/fp16 each is the very GEMM the unsplit backward
runs (``grad^T @ x`` in the compute dtype, same operands), a weight's several GEMMs of one
backward summed in queue order, which is the order autograd's input buffer sums them in; the
hook folds the result into the fp32 main grad as it folds an unsplit ``.grad``. One exception:
in bf16/fp16 a ``zero_out_wgrad`` weight (a lookup and a GEMM in one backward) keeps its GEMM in
``B``, since autograd rounds the lookup's and the GEMM's sum in the compute dtype before the
hook sees it. Under FP8 (:mod:`workers.parallel.fp8`) the GEMM's weight is a dequantised copy
that names its parameter (``wgrad_param``): never fused into fp32 main grads, its deferred GEMM is handed back cast
to the parameter's dtype, as the copy's straight-through cast hands it back in an unsplit
backward. The same GEMMs in the same microbatch order: the gradients do not change, bit for
bit. Without ``main_grad`` (a module used on its own) nothing is deferred and ``W`` has nothing
to do.

With float64 main grads (``main_grads_dtype: fp64``) every sum over the tokens that lands in
the buffer is taken in float64 on the backward's own operands, so where a layout cuts the
tokens (CP, SP) the result is the single process's to ~1e-16, far below the last fp32 bit: the
weight-gradient GEMMs (:func:`_fused`) and the token sums outside any GEMM, the norms' weight
gradients (:mod:`workers.model.fused`), the embedding lookup's (:func:`lookup`) and a linear
bias's (:func:`add_bias`), which add into ``main_grad`` themselves when :func:`wide_owner`
holds and hand autograd the same dummy. The MoE router's and the experts' grouped GEMMs keep
fp32 sums over the tokens: an MoE layer is not exact under CP.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from workers.parallel import fp8_gemm
from workers.parallel.fp8 import ScaledGemm


def grad_owner(weight: torch.Tensor) -> torch.Tensor | None:
    """The parameter whose gradient this forward's backward hands to :func:`weight_grad`'s
    protocol (it has a ``main_grad``, of any dtype, and a graph is being recorded): ``weight``
    itself, or, for an FP8 linear's dequantised copy (:mod:`workers.parallel.fp8`), the
    parameter it names as ``wgrad_param``; else ``None``."""
    param = getattr(weight, "wgrad_param", weight)
    if getattr(param, "main_grad", None) is None or not (weight.requires_grad and torch.is_grad_enabled()):
        return None
    return param


def fuses(weight: torch.Tensor) -> bool:
    """Whether this forward's backward accumulates ``weight``'s gradient straight into its
    ``main_grad`` (the parameter itself, a buffer view of its dtype, and a graph being recorded)."""
    param = grad_owner(weight)
    return param is not None and _fused(param, weight, getattr(weight, "fp8_gemm", None))


def _fused(param: torch.Tensor, owner: torch.Tensor, gemm: ScaledGemm | None) -> bool:
    """Whether ``owner``'s weight-gradient GEMM accumulates into ``param.main_grad``: it has the
    weight's dtype (the fp32 path), or it is float64 (``main_grads_dtype: fp64``, any weight
    dtype, FP8's dequantised copies and ``_scaled_mm`` linears too): then the GEMM runs in
    float64 on the operands cast up (a ``_scaled_mm`` linear's FP8 bits, then its two reciprocal
    scales, :func:`workers.parallel.fp8_gemm.wgrad_wide`), every product exact, so where a layout
    cuts the token sum (CP, SP) the result is the single process's to the last fp32 bit."""
    main = param.main_grad
    return (param is owner and main.dtype == param.dtype) or main.dtype == torch.float64


def wide_owner(weight: torch.Tensor) -> torch.Tensor | None:
    """The parameter (``weight`` itself) when its gradient goes to a float64 ``main_grad``
    (``main_grads_dtype: fp64``, :func:`grad_owner` held): then a sum over the tokens outside
    any GEMM (a norm's weight gradient, an embedding lookup's) is taken in float64 into the
    buffer, as the weight-gradient GEMMs are (:func:`_fused`), and autograd gets
    :func:`handed_to_main_grad`'s dummy; else ``None``."""
    param = grad_owner(weight)
    return param if param is not None and param.main_grad.dtype == torch.float64 else None


def handed_to_main_grad(param: torch.Tensor) -> torch.Tensor:
    """What a backward hands autograd for ``param`` after adding its gradient into
    ``param.main_grad`` itself (the fused GEMM's dummy, see the module docstring)."""
    return _dummy(param)


def _accumulate(param: torch.Tensor, grad_2d: torch.Tensor, x_2d: torch.Tensor, gemm: ScaledGemm | None) -> None:
    """``param.main_grad += grad^T @ x``, in ``main_grad``'s dtype."""
    main = param.main_grad
    if gemm is not None:
        main.add_(fp8_gemm.wgrad_wide(grad_2d, x_2d, gemm, main.dtype))
    else:
        main.addmm_(grad_2d.t().to(main.dtype), x_2d.to(main.dtype))


def weight_grad(grad: torch.Tensor, x: torch.Tensor, owner: torch.Tensor | None,
                gemm: ScaledGemm | None = None) -> torch.Tensor | None:
    """``dL/dW`` of ``y = x @ W.T`` (``grad^T @ x`` over every token; ``gemm``: an FP8
    ``_scaled_mm``, :mod:`workers.parallel.fp8_gemm`). ``owner``: the GEMM's
    weight where :func:`grad_owner` held in the forward; then, inside :func:`deferred_wgrads`,
    the GEMM is queued and ``None`` returned, and otherwise, on the fp32 path, accumulated into
    ``owner.main_grad`` and a dummy returned (see the module docstring)."""
    grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    param = None if owner is None else getattr(owner, "wgrad_param", owner)
    if param is None or torch.is_grad_enabled() or getattr(param, "main_grad", None) is None:
        return fp8_gemm.wgrad(grad_2d, x_2d, gemm)  # create_graph, or no buffer (any more): plain autograd
    fused = _fused(param, owner, gemm)  # otherwise an FP8 copy's gradient goes through its cast
    if _deferred is not None and (fused or not getattr(param, "zero_out_wgrad", False)):
        # A zero-bubble B: the GEMM waits for run_wgrads, autograd gets nothing for the weight.
        _deferred.append((param, grad_2d, x_2d, fused, gemm))
        param.wgrad_deferred = getattr(param, "wgrad_deferred", 0) + 1  # GEMMs queued, not yet run
        return None
    if not fused:  # bf16/fp16, FP8: autograd (the cast's backward), AccumulateGrad and the hook take it
        return fp8_gemm.wgrad(grad_2d, x_2d, gemm)
    _accumulate(param, grad_2d, x_2d, gemm)
    return _dummy(param)


def _dummy(fused: torch.Tensor) -> torch.Tensor:
    """The gradient autograd gets for a weight whose GEMM went into ``main_grad`` (module docstring)."""
    fused.grad_added_to_main_grad = True
    fused.grad = None
    if getattr(fused, "zero_out_wgrad", False):
        return torch.zeros_like(fused)
    return torch.empty_like(fused)


_deferred: list | None = None
"""Where :func:`weight_grad` queues its GEMMs inside :func:`deferred_wgrads`. A module global,
not thread-local: autograd runs a CUDA backward on its own device thread."""


@contextlib.contextmanager
def deferred_wgrads():
    """Queue the weight-gradient GEMMs of the backwards run inside; yields the queue, for
    :func:`run_wgrads`."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield _deferred
    finally:
        _deferred = outer


def run_wgrads(queue: list) -> None:
    """Run the GEMMs :func:`deferred_wgrads` queued (in their order), then hand each weight its
    gradient through autograd (the fp32 path's dummy; otherwise the GEMM itself, in the
    parameter's dtype as an FP8 copy's cast hands it back, a weight's several GEMMs summed in
    queue order as autograd's input buffer sums them), so its post-accumulate hook runs as after
    an unsplit backward."""
    grads: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    with torch.no_grad():
        for weight, grad_2d, x_2d, fused, gemm in queue:
            if fused:
                _accumulate(weight, grad_2d, x_2d, gemm)
                grads[id(weight)] = (weight, None)
            else:
                out = fp8_gemm.wgrad(grad_2d, x_2d, gemm).to(weight.dtype)
                _, held = grads.get(id(weight), (weight, None))
                grads[id(weight)] = (weight, out if held is None else held + out)
            weight.wgrad_deferred -= 1
    queue.clear()
    if grads:
        params = tuple(p for p, _ in grads.values())
        handed = tuple(_dummy(p) if g is None else g for p, g in grads.values())
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=params, grad_tensors=handed, keep_graph=False, create_graph=False,
            inputs=(), allow_unreachable=True, accumulate_grad=True)


class LinearFusedWgrad(torch.autograd.Function):
    """``x @ W.T`` (``+ residual``, one addmm) with the weight gradient through
    :func:`weight_grad` (fused into ``W.main_grad`` in fp32, deferrable in any precision): the
    no-TP path of the parallel linears when :func:`grad_owner` holds. Its forward is
    ``F.linear``'s and its backward the two GEMMs autograd runs for it, with the same operands:
    the values are ``F.linear``'s, bit for bit."""

    @staticmethod
    def forward(ctx, x, weight, residual):
        ctx.owner, ctx.gemm = weight, getattr(weight, "fp8_gemm", None)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(x, weight)
        if residual is None:
            return fp8_gemm.forward(x, weight, ctx.gemm)
        y = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
        return y.view(residual.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = fp8_gemm.dgrad(grad, weight, ctx.gemm) if ctx.needs_input_grad[0] else None
        grad_weight = weight_grad(grad, x, ctx.owner, ctx.gemm)
        return grad_input, grad_weight, grad if ctx.has_residual else None


def linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ residual)``, through :class:`LinearFusedWgrad` when ``weight`` has a
    ``main_grad`` (:func:`grad_owner`); otherwise ``F.linear`` (and, with a residual, one
    ``torch.addmm``)."""
    if grad_owner(weight) is not None or getattr(weight, "fp8_gemm", None) is not None:
        return LinearFusedWgrad.apply(x, weight, residual)
    if residual is None:
        return F.linear(x, weight)
    y = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
    return y.view(residual.shape)


class _WideLookup(torch.autograd.Function):
    """``F.embedding`` whose weight gradient, each row's sum over the tokens that look it up,
    is added in float64 into the weight's float64 ``main_grad``
    (:func:`wide_owner`): the same sums however a layout cuts the tokens."""

    @staticmethod
    def forward(ctx, ids, weight, owner):
        ctx.save_for_backward(ids)
        ctx.owner = owner
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        main = ctx.owner.main_grad
        main.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main.dtype))
        return None, _dummy(ctx.owner), None


def lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)``, through :class:`_WideLookup` when :func:`wide_owner` holds."""
    owner = wide_owner(weight)
    return F.embedding(ids, weight) if owner is None else _WideLookup.apply(ids, weight, owner)


class _WideBias(torch.autograd.Function):
    """``y + bias`` whose bias gradient, the sum of ``y``'s gradient over the tokens, is added in
    float64 into the bias's float64 ``main_grad`` (:func:`wide_owner`)."""

    @staticmethod
    def forward(ctx, y, bias, owner):
        ctx.owner = owner
        return y + bias

    @staticmethod
    def backward(ctx, grad):
        main = ctx.owner.main_grad
        main.add_(grad.reshape(-1, grad.shape[-1]).to(main.dtype).sum(0))
        return grad, _dummy(ctx.owner), None


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y + bias``, through :class:`_WideBias` when :func:`wide_owner` holds."""
    owner = wide_owner(bias)
    return y + bias if owner is None else _WideBias.apply(y, bias, owner)
