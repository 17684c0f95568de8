"""Activation recomputation, Megatron's semantics (``recompute_granularity``, ``_method``, ``_num_layers``).

* ``full`` + ``uniform``: the chunk's layers in groups of ``recompute_num_layers``; each group
  keeps only its input and reruns its forward during backward;
* ``full`` + ``block``: the first ``recompute_num_layers`` layers of each pipeline model chunk
  are recomputed one by one, the rest keep their activations (spend spare memory on speed);
* ``selective``: only the attention core (the ``softmax(q k^T) v`` part) is recomputed, the
  biggest activation per FLOP.

Recomputation reruns the same ops on the same inputs: the results are bit-identical. What
must not run twice is a side effect of a forward; code that has one (the MoE aux-loss record)
asks :func:`is_recomputing`. Communication inside a recomputed region (SP all-gathers, CP
ring exchanges, MoE all-to-all) reruns too, on every rank of the group in the same backward
order, so the collectives still match. Dropout is 0 (nothing random in forward); the RNG state
is preserved anyway (``preserve_rng_state``), as Megatron's checkpoint does.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

_STATE = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed region reruns its forward during backward."""
    return getattr(_STATE, "depth", 0) > 0


def checkpointed(fn: Callable, *args):
    """``fn(*args)`` keeping only its inputs; its forward reruns in backward.

    Without grad (evaluation) it is a plain call.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    calls = [0]

    def run(*inner):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inner)
        _STATE.depth = getattr(_STATE, "depth", 0) + 1
        try:
            return fn(*inner)
        finally:
            _STATE.depth -= 1

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def run_layers(layers: Sequence[torch.nn.Module], x: torch.Tensor, rotary: torch.Tensor, cfg) -> torch.Tensor:
    """Run a model chunk's layers with ``cfg``'s full recomputation (selective is in the layer)."""
    if cfg.recompute_granularity != "full" or not torch.is_grad_enabled():
        for layer in layers:
            x = layer(x, rotary)
        return x
    n = cfg.recompute_num_layers
    if cfg.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            group = layers[start : start + n]

            def run_group(h, rot, group=group):
                for layer in group:
                    h = layer(h, rot)
                return h

            x = checkpointed(run_group, x, rotary)
        return x
    if cfg.recompute_method == "block":
        for i, layer in enumerate(layers):
            x = checkpointed(layer, x, rotary) if i < n else layer(x, rotary)
        return x
    raise ValueError(f"recompute_method {cfg.recompute_method!r} is not uniform or block")
