"""One MoE layer, forward + backward: the per-expert Python loop vs the grouped GEMM.

    .venv/bin/python bench/moe_bench.py [--tokens 4096] [--iters 10] [--threads 1] [--dtypes fp32 bf16]

Mixtral-shaped layer (E 8, top-2, h 256, ffn 512), one rank (no EP), random router. For each
dtype the same :class:`~workers.parallel.expert.MoELayer` runs twice: with its experts as they
are (:func:`~workers.parallel.grouped_gemm.swiglu_experts`: ``torch._grouped_mm`` on CUDA
sm90+ bf16, one padded ``bmm`` elsewhere) and with :func:`loop_swiglu_experts`, the loop the
product code had before (one GEMM chain per expert, kept here as the reference). Reported:
the median time of a whole layer's forward + backward and of the experts' alone, the host
syncs of one layer forward + backward (:class:`HostSyncCounter`), and the largest difference
between the two paths' outputs and gradients.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

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
    """

    _DATA_DEPENDENT = ("nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "bincount")

    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self._in_patched = 0

    @property
    def count(self) -> int:
        return len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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


def _median_ms(fn, iters: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def compare(tokens: int, dtype: torch.dtype, iters: int, device: str = "cpu") -> dict:
    """Both paths on the same layer and tokens: times, syncs and the largest differences."""
    layer = make_layer(dtype=dtype, device=device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 1, layer.experts.hidden_size, generator=g).to(device, dtype).requires_grad_(True)
    grad = torch.randn(x.shape, generator=g).to(device, dtype)
    flat = x.detach().reshape(tokens, -1)
    _, topk_idx, _ = layer.router(flat)
    expert_in, runs, _ = layer.dispatcher.dispatch(flat, topk_idx)
    expert_in.requires_grad_(True)
    expert_grad = torch.randn(expert_in.shape, generator=g).to(device, dtype)

    out = {"counts": runs.counts}
    for name, loop in (("loop", True), ("grouped", False)):
        _use_loop(layer, loop)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        counter = HostSyncCounter()
        with counter:
            y = _step(layer, x, grad)
        grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

        def whole():
            _step(layer, x, grad)

        def experts_only():
            layer.experts(expert_in, runs).backward(expert_grad)

        expert_counter = HostSyncCounter()
        with expert_counter:
            experts_only()

        out[name] = {"layer_ms": _median_ms(whole, iters), "experts_ms": _median_ms(experts_only, iters),
                     "layer_syncs": counter.count, "experts_syncs": expert_counter.count, "sync_events": counter.events, "y": y.detach(), "grads": grads}
    _use_loop(layer, False)
    a, b = out["loop"], out["grouped"]
    out["max_abs_diff_y"] = (a["y"].float() - b["y"].float()).abs().max().item()
    out["max_abs_diff_grads"] = max((p.float() - q.float()).abs().max().item() for p, q in zip(a["grads"], b["grads"]))
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
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared box)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"MoE layer E 8, top-2, T {args.tokens}, h 256, ffn 512, {args.device}, {args.threads} thread(s); "
          f"median of {args.iters}, forward + backward")
    print(f"{'dtype':6} {'part':8} {'loop ms':>9} {'grouped ms':>11} {'loop/grouped':>13} {'syncs loop':>11} "
          f"{'syncs grouped':>14}")
    for name in args.dtypes:
        if name == "bf16" and args.device == "cpu" and not bf16_supported():
            print("bf16: not supported by this CPU build, skipped")
            continue
        r = compare(args.tokens, DTYPES[name], args.iters, args.device)
        for part in ("layer", "experts"):
            lo, gr = r["loop"][f"{part}_ms"], r["grouped"][f"{part}_ms"]
            print(f"{name:6} {part:8} {lo:9.2f} {gr:11.2f} {lo / gr:13.2f} {r['loop'][f'{part}_syncs']:11d} "
                  f"{r['grouped'][f'{part}_syncs']:14d}")
        counts = r["counts"]
        print(f"{name:6} rows per expert {counts} (padding {max(counts) * len(counts) / sum(counts) - 1:.1%}); "
              f"sync events loop {r['loop']['sync_events']} grouped {r['grouped']['sync_events']}; "
              f"max |diff| y {r['max_abs_diff_y']:.3g}, grads {r['max_abs_diff_grads']:.3g}")


if __name__ == "__main__":
    main()
