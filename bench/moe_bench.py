"""One MoE layer, forward + backward: the per-expert Python loop vs the grouped GEMM.

    .venv/bin/python -m bench.moe_bench [--tokens 4096] [--iters 10] [--threads 1] [--dtypes fp32 bf16]

Mixtral-shaped layer (E 8, top-2, h 256, ffn 512), one rank (no EP), random router. For each
dtype the same :class:`~workers.parallel.expert.MoELayer` runs twice: with its experts as they
are (:func:`~workers.parallel.grouped_gemm.swiglu_experts`: ``torch._grouped_mm`` on CUDA
sm90+ bf16, one padded ``bmm`` elsewhere) and with :func:`loop_swiglu_experts`, the loop the
product code had before (one GEMM chain per expert, kept here as the reference). Reported:
the median and the fastest CPU time of a whole layer's forward + backward and of the experts'
alone (the two paths alternate run by run), the aten ops and host syncs of one forward +
backward (:class:`HostSyncCounter`), and the largest difference between the two paths' outputs and
gradients, relative to the largest value.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def loop_swiglu_experts(x, w_gate, w_up, w_down, runs) -> torch.Tensor:
    """The pre-grouped-GEMM experts: one GEMM chain per local expert, in a Python loop."""
    outs = []
    for i, rows in enumerate(torch.split(x, runs.counts)):
        hidden = F.silu(rows @ w_gate[i].t()) * (rows @ w_up[i].t())
        outs.append(hidden @ w_down[i].t())
    return torch.cat(outs)


class HostSyncCounter(TorchDispatchMode):
    """Counts what makes the host wait for the device, as a context manager.

    On CUDA each of these blocks the CPU until the stream drains; on CPU they cost nothing,
    so they are counted by what they are, not timed:

    * ``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor;
    * ops whose output shape depends on the data (``nonzero``, ``masked_select``, ``unique``,
      ``bincount``, ``repeat_interleave`` without ``output_size``);
    * copies from a device to the CPU (``.cpu()``, ``.to("cpu")``);
    * ``Tensor.tolist`` and ``Tensor.numpy``, patched, since on a CPU tensor they read the
      memory directly and dispatch nothing (on CUDA the copy under them is not counted twice).

    Attributes:
        events: the name of each sync, in order.
        num_ops: every aten op dispatched (on a GPU, roughly the kernel launches).
    """

    _DATA_DEPENDENT = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "bincount")

    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self.num_ops = 0
        self._in_patched = 0

    @property
    def count(self) -> int:
        return len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.num_ops += 1
        if not self._in_patched:
            name = func.overloadpacket.__name__
            if func is aten._local_scalar_dense.default or name in self._DATA_DEPENDENT:
                self.events.append(name)
            elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
                self.events.append("repeat_interleave")
            elif name in ("_to_copy", "copy_") and _to_host(func, args, kwargs):
                self.events.append(f"{name}->cpu")
        return func(*args, **kwargs)

    def __enter__(self):
        self._saved = {m: getattr(torch.Tensor, m) for m in ("tolist", "numpy")}
        for method, real in self._saved.items():
            setattr(torch.Tensor, method, self._counted(method, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for method, real in self._saved.items():
            setattr(torch.Tensor, method, real)
        return super().__exit__(*exc)

    def _counted(self, method, real):
        def wrapper(tensor, *args, **kwargs):
            self.events.append(method)
            self._in_patched += 1
            try:
                return real(tensor, *args, **kwargs)
            finally:
                self._in_patched -= 1
        return wrapper


def _to_host(func, args, kwargs) -> bool:
    """Whether a ``_to_copy`` / ``copy_`` moves a non-CPU tensor's data to the CPU."""
    if func.overloadpacket.__name__ == "copy_":
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    src, device = args[0], kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu" and src.device.type != "cpu"


def make_layer(num_experts=8, topk=2, hidden=256, ffn=512, dtype=torch.float32, device="cpu", seed=0):
    """A single-rank :class:`MoELayer` with random weights (std 0.02; router std 1 so routing varies)."""
    from workers.parallel.expert import MoELayer

    g = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=g)
    wg, wu = (torch.randn(num_experts, ffn, hidden, generator=g) * 0.02 for _ in range(2))
    wd = torch.randn(num_experts, hidden, ffn, generator=g) * 0.02
    layer = MoELayer.from_full(router, wg, wu, wd, topk=topk)
    return layer.to(device=device, dtype=dtype)


def _use_loop(layer, on: bool) -> None:
    """Swap the layer's experts to the reference loop (``on``) or back to the grouped GEMM."""
    ex = layer.experts
    if on:
        ex.forward = lambda x, runs: loop_swiglu_experts(x, ex.w_gate, ex.w_up, ex.w_down, runs)
    else:
        ex.__dict__.pop("forward", None)


def _step(layer, x, grad):
    y, _ = layer(x)
    y.backward(grad)
    return y


PATHS = (("loop", True), ("grouped", False))


def _interleaved_ms(layer, fns: dict, iters: int) -> dict:
    """``{(path, part): [ms, ...]}`` of process CPU time, the two paths alternating run by run.

    CPU time, not wall time: on a shared, oversubscribed machine wall time mostly measures the
    neighbours (a load of 20 on 2 cores made medians and minima disagree by 2x); CPU time
    still carries their cache pressure, and alternating spreads that over both paths alike.
    """
    times = {(path, part): [] for path, _ in PATHS for part in fns}
    for i in range(iters + 1):
        for path, loop in PATHS:
            _use_loop(layer, loop)
            for part, fn in fns.items():
                t0 = time.process_time()
                fn()
                if i:  # run 0 is the warm-up: first-call allocations and kernel selection
                    times[(path, part)].append(1e3 * (time.process_time() - t0))
    _use_loop(layer, False)
    return times


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(tokens: int, dtype: torch.dtype, iters: int, device: str = "cpu", **shape) -> dict:
    """Both paths on the same layer and tokens: times, syncs and the largest differences.

    ``shape``: :func:`make_layer`'s ``num_experts``, ``topk``, ``hidden``, ``ffn``.
    """
    layer = make_layer(dtype=dtype, device=device, **shape)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 1, layer.experts.hidden_size, generator=g).to(device, dtype).requires_grad_(True)
    grad = torch.randn(x.shape, generator=g).to(device, dtype)
    flat = x.detach().reshape(tokens, -1)
    _, topk_idx, _ = layer.router(flat)
    expert_in, runs, _ = layer.dispatcher.dispatch(flat, topk_idx)
    expert_in.requires_grad_(True)
    expert_grad = torch.randn(expert_in.shape, generator=g).to(device, dtype)
    fns = {"layer": lambda: _step(layer, x, grad),
           "experts": lambda: layer.experts(expert_in, runs).backward(expert_grad)}

    out = {"counts": runs.counts}
    for path, loop in PATHS:
        _use_loop(layer, loop)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with HostSyncCounter() as layer_syncs:
            y = _step(layer, x, grad)
        grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
        with HostSyncCounter() as expert_syncs:
            fns["experts"]()
        out[path] = {"layer_syncs": layer_syncs.count, "experts_syncs": expert_syncs.count,
                     "layer_ops": layer_syncs.num_ops, "experts_ops": expert_syncs.num_ops,
                     "sync_events": layer_syncs.events, "y": y.detach(), "grads": grads}
    for (path, part), ms in _interleaved_ms(layer, fns, iters).items():
        out[path][f"{part}_ms"] = statistics.median(ms)
        out[path][f"{part}_min_ms"] = min(ms)
    a, b = out["loop"], out["grouped"]
    out["rel_diff_y"] = _rel_diff(b["y"], a["y"])
    out["rel_diff_grads"] = max(_rel_diff(q, p) for p, q in zip(a["grads"], b["grads"]))
    return out


def bf16_supported() -> bool:
    try:
        torch.bmm(torch.ones(1, 2, 2, dtype=torch.bfloat16), torch.ones(1, 2, 2, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared box)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = dict(num_experts=args.experts, topk=args.topk, hidden=args.hidden, ffn=args.ffn)
    print(f"MoE layer E {args.experts}, top-{args.topk}, T {args.tokens}, h {args.hidden}, ffn {args.ffn}, "
          f"{args.device}, {args.threads} thread(s); "
          f"median of {args.iters}, forward + backward")
    print("CPU ms: process CPU time (median and fastest); ops: aten ops dispatched; syncs: host syncs")
    print(f"{'dtype':6} {'part':8} {'loop ms':>9} {'grouped ms':>11} {'ratio':>6} {'min loop':>9} {'min grouped':>12} "
          f"{'ratio':>6} {'ops loop':>9} {'ops grouped':>12} {'syncs loop':>11} {'syncs grouped':>14}")
    for name in args.dtypes:
        if name == "bf16" and args.device == "cpu" and not bf16_supported():
            print("bf16: not supported by this CPU build, skipped")
            continue
        r = compare(args.tokens, DTYPES[name], args.iters, args.device, **shape)
        lo, gr = r["loop"], r["grouped"]
        for part in ("layer", "experts"):
            med, low = (lo[f"{part}_ms"], gr[f"{part}_ms"]), (lo[f"{part}_min_ms"], gr[f"{part}_min_ms"])
            print(f"{name:6} {part:8} {med[0]:9.1f} {med[1]:11.1f} {med[0] / med[1]:6.2f} {low[0]:9.1f} "
                  f"{low[1]:12.1f} {low[0] / low[1]:6.2f} {lo[f'{part}_ops']:9d} {gr[f'{part}_ops']:12d} "
                  f"{lo[f'{part}_syncs']:11d} {gr[f'{part}_syncs']:14d}")
        counts = r["counts"]
        shown = counts if len(counts) <= 16 else f"{min(counts)}..{max(counts)} over {len(counts)} experts"
        print(f"{name:6} rows per expert {shown} (padding {max(counts) * len(counts) / sum(counts) - 1:.1%}); "
              f"sync events loop {lo['sync_events']} grouped {gr['sync_events']}; max |grouped - loop| / max |loop|: "
              f"y {r['rel_diff_y']:.2g}, grads {r['rel_diff_grads']:.2g}")


if __name__ == "__main__":
    main()
