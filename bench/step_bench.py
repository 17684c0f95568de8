"""One process, CPU: where a training step's time and memory go, measured side by side (run by hand).

    .venv/bin/python -m bench.step_bench [--iters 6] [--warmup 2] [--only ops,bytes,adamw,syncs,step]

Prints, each figure next to its reference:

* ``ops``: aten ops dispatched per decoder layer, forward + backward, views and bare
  allocations left out (a ``TorchDispatchMode`` counter around one layer; its GEMMs, attention
  and the accumulation of its param grads included);
* ``bytes``: activation bytes saved for backward per token per layer (``saved_tensors_hooks``,
  each storage counted once), in units of the hidden size ``h``;
* ``adamw``: raytron's optimizer ``step()`` (replicated and ZeRO-1, with clipping) over 4M fp32
  elements vs a bare ``torch._fused_adamw_`` over the same buffers;
* ``syncs``: host syncs in one training step (fp32, bf16, fp16), counted by
  :class:`bench.moe_bench.HostSyncCounter`; the data sampler's reads of its CPU generator
  (host memory, no device wait) apart from the rest (each of which drains a CUDA queue);
* ``step``: raytron's single-process trainer vs the loop a user writes with transformers'
  ``LlamaForCausalLM`` + ``torch.optim.AdamW`` on the same model (weights copied over), the same
  batches and the same math (clipping, weight decay on 2-D params only); iterations
  alternate so machine load hits both alike; medians and their ratio, and the largest loss gap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from service.spec.spec import parse_spec, to_job_config  # noqa: E402

MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
         "ffn_hidden_size": 1024, "vocab_size": 256, "seq_length": 256}
TRAINING = {"train_iters": 100, "global_batch_size": 8, "micro_batch_size": 8, "lr": 1e-3, "seed": 11,
            "weight_decay": 0.1}


def step_job(model: dict | None = None, training: dict | None = None):
    return to_job_config(parse_spec({
        "name": "step-bench", "model": {**MODEL, **(model or {})}, "parallel": {},
        "training": {**TRAINING, **(training or {})}, "resources": {"num_nodes": 1, "gpus_per_node": 1},
    }))


# Ops that only make a new view of memory or allocate it (no kernel on any device).
_METADATA_OPS = {"_unsafe_view", "_reshape_alias", "alias", "detach", "lift_fresh", "empty", "empty_like",
                 "empty_strided"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel as they are dispatched: views and bare
    allocations (``empty*``) are left out."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view or func._opname in _METADATA_OPS:
            self.views += 1
        else:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _one_layer(job):
    from workers.model.decoder import ShardContext, rotary_tables
    from workers.model.layer import DecoderLayer

    m = job.model
    layer = DecoderLayer(m, ShardContext(seed=job.training.seed), 0)
    rotary = rotary_tables(torch.arange(m.seq_length), m.head_dim, m.rotary_base)
    x = torch.randn(m.seq_length, job.training.micro_batch_size, m.hidden_size, requires_grad=True)
    return layer, rotary, x


def ops_per_layer(job) -> int:
    """aten ops of one decoder layer's forward and backward (grads into the layer's params)."""
    layer, rotary, x = _one_layer(job)
    layer(x, rotary).sum().backward()  # warm: lazy inits happen outside the count
    seed = torch.ones(x.shape)
    with OpCounter() as counter:
        layer(x, rotary).backward(seed)
    return counter.count


def saved_bytes_per_token(job) -> float:
    """Bytes one decoder layer saves for backward per token (distinct storages; the layer's
    params and buffers left out, as bench/sp_memory.py does)."""
    layer, rotary, x = _one_layer(job)
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, rotary)
    del y
    params = {p.untyped_storage().data_ptr() for p in [*layer.parameters(), *layer.buffers()]}
    total = sum(n for ptr, n in seen.items() if ptr not in params)
    return total / (x.shape[0] * x.shape[1])


ADAMW_SHAPES = [(1000, 1000)] * 4 + [(500,)] * 4  # 4.002 M fp32 elements, 2-D decay, 1-D not
ADAMW_HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def adamw_times(reps: int = 15) -> dict:
    """Median ms of raytron's optimizer ``step()`` (finish the size-1 reduction, global norm,
    update; with and without clipping) vs bare ``torch._fused_adamw_`` on the same shapes, and
    vs that op after torch's ``clip_grad_norm_``; rounds alternate between them.

    Every timed step starts from the same fresh gradients (a step clips them in place, and
    clipped-again grads would sink into denormals, which are slow on a CPU).
    """
    from workers.parallel.optimizer import build_optimizer

    torch.manual_seed(0)
    fresh = torch.randn(sum(torch.Size(s).numel() for s in ADAMW_SHAPES))  # a norm of ~2000: clipped at 1
    runs = {}
    for kind, distributed, clip in (("replicated", False, 0.0), ("replicated+clip", False, 1.0),
                                    ("zero1", True, 0.0), ("zero1+clip", True, 1.0)):
        params = [torch.nn.Parameter(torch.randn(s)) for s in ADAMW_SHAPES]
        opt = build_optimizer([(params, None)], distributed=distributed, clip_grad=clip, **ADAMW_HP)

        def prepare(opt=opt):
            opt.grads.buffers[0].grad.copy_(fresh)
            opt.grads._finished = False  # as after a backward: the (size-1) reduction runs again

        runs[kind] = (prepare, opt.step)
    ps = [torch.randn(s) for s in ADAMW_SHAPES]
    gs = [torch.empty(s) for s in ADAMW_SHAPES]
    ms, vs = [torch.zeros(s) for s in ADAMW_SHAPES], [torch.zeros(s) for s in ADAMW_SHAPES]
    steps = [torch.tensor(0.0) for _ in ps]

    def prepare_fused():
        torch._foreach_copy_(gs, [f.view_as(g) for f, g in zip(fresh.split([g.numel() for g in gs]), gs)])
        torch._foreach_add_(steps, 1.0)  # what torch.optim does before the fused op

    def fused():
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
                            amsgrad=False, maximize=False)

    def clip_then_fused():
        torch.nn.utils.clip_grad_norm_(gs_as_params, 1.0)
        fused()

    # clip_grad_norm_ reads .grad: parameters whose grads are the reference's grads.
    gs_as_params = [torch.nn.Parameter(torch.empty(g.shape)) for g in gs]
    for p, g in zip(gs_as_params, gs):
        p.grad = g
    runs["torch._fused_adamw_"] = (prepare_fused, fused)
    runs["clip_grad_norm_+fused"] = (prepare_fused, clip_then_fused)
    samples = {k: [] for k in runs}
    for _ in range(reps + 1):
        for name, (prepare, fn) in runs.items():
            prepare()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v[1:]) * 1e3 for k, v in samples.items()}


def host_syncs_per_step(job) -> dict:
    """Host syncs in one ``train_step`` after a warm-up one: ``step`` (the trainer's own) and
    ``loader`` (inside ``sampler.batch``), with the trainer's events by name."""
    from bench.moe_bench import HostSyncCounter
    from workers.train.trainer import Trainer

    trainer = Trainer(job, 0, 1)
    try:
        trainer.train_step()
        real, counter, loader = trainer.sampler.batch, HostSyncCounter(), []

        def batch(*args, **kwargs):
            before = len(counter.events)
            out = real(*args, **kwargs)
            loader.append(len(counter.events) - before)
            del counter.events[before:]
            return out

        trainer.sampler.batch = batch
        with counter:
            trainer.train_step()
        return {"step": counter.count, "loader": sum(loader), "events": counter.events}
    finally:
        trainer.close()


def step_times(iters: int, warmup: int) -> dict:
    """Alternate raytron's single-process trainer and the HF loop; median step seconds, losses."""
    from bench.hf_loop import HFLoop
    from workers.train.trainer import Trainer

    trainer = Trainer(step_job(), 0, 1)
    runners = {"raytron": trainer, "hf": HFLoop(trainer)}
    times, losses = {k: [] for k in runners}, {k: [] for k in runners}
    for i in range(warmup + iters):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            out = runner.train_step()
            dt = time.perf_counter() - t0
            losses[name].append(out["loss"])
            if i >= warmup:
                times[name].append(dt)
    trainer.close()
    paired = statistics.median(a / b for a, b in zip(times["raytron"], times["hf"]))
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "paired_ratio": paired,
            "loss_diff": max(abs(a - b) for a, b in zip(losses["raytron"], losses["hf"])), "losses": losses}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=6, help="timed steps of each (step)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each (step)")
    ap.add_argument("--only", default="ops,bytes,adamw,syncs,step", help="comma-separated subset")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1, as PERF_NOTES; on a shared machine a descheduled 2nd thread stalls ops)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    job = step_job()
    m, t = job.model, job.training
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model L{m.num_layers} h{m.hidden_size} "
          f"heads {m.num_attention_heads}/{m.num_query_groups} ffn {m.ffn_hidden_size} s{m.seq_length} "
          f"gbs{t.global_batch_size} mbs{t.micro_batch_size}")
    if "ops" in only:
        print(f"ops per decoder layer, fwd+bwd (kernels: views and allocations excluded): {ops_per_layer(job)}"
              "  (target <= 60)")
    if "bytes" in only:
        print(f"saved activations per token per layer: {saved_bytes_per_token(job) / m.hidden_size:.1f} h bytes")
    if "adamw" in only:
        ms = adamw_times()
        print(f"AdamW step over {sum(torch.Size(s).numel() for s in ADAMW_SHAPES) / 1e6:.3f} M fp32 elements, "
              "median ms (x: over the reference on the same line; target <= 1.3):")
        for name, ref in (("replicated", "torch._fused_adamw_"), ("zero1", "torch._fused_adamw_"),
                          ("replicated+clip", "clip_grad_norm_+fused"), ("zero1+clip", "clip_grad_norm_+fused")):
            print(f"  {name:<16} {ms[name]:7.2f} ms  vs {ref:<22} {ms[ref]:7.2f} ms  {ms[name] / ms[ref]:5.2f}x")
    if "syncs" in only:
        for name, extra in (("fp32", {}), ("bf16", {"bf16": True}), ("fp16", {"fp16": True})):
            n = host_syncs_per_step(step_job(training=extra))
            print(f"host syncs in one {name} step: {n['step']} {n['events']} (target <= 1), plus {n['loader']} "
                  "host-only reads of the sampler's CPU generator; H2D copies pinned + non_blocking on CUDA")
    if "step" in only:
        out = step_times(args.iters, args.warmup)
        med = out["median_s"]
        print(f"one-process step, {args.warmup} warm-up + {args.iters} timed each, alternating: raytron "
              f"{med['raytron']:.4f} s, transformers LlamaForCausalLM + torch.optim.AdamW {med['hf']:.4f} s, "
              f"ratio {med['raytron'] / med['hf']:.3f} (paired {out['paired_ratio']:.3f}; target <= 0.9); "
              f"largest loss gap {out['loss_diff']:.1e}")


if __name__ == "__main__":
    main()
