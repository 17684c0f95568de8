"""Peak memory and step time per rank under context parallelism; saved activations and CP / EP bytes.

    .venv/bin/python -m bench.cp_memory                  # peak + time at seq 8192 and 16384, then the rest
    .venv/bin/python -m bench.cp_memory --quick          # peak + time at seq 8192 only
    .venv/bin/python -m bench.cp_memory --seqs 4096,8192 --iters 3 --no-saved

**Peak and time.** For each sequence length, cp = 1 (plain fused causal attention) and cp = 2
(ring attention; ``--all-gather`` adds the all-gather variant) train ``--iters`` iterations
of one microbatch (2 layers, h 64, 4 heads in 2 query groups, fp32), each rank a process of
:func:`tests.helpers.ranks.run_ranks`. Per rank (the max over ranks is printed): ``VmHWM``, the
kernel's peak resident set of the process, which includes what the process had before the
model was built (the torch import, inherited from the forkserver: about 200 MiB that no
parallelism divides); ``VmRSS`` once the trainer is built; their difference, what training
added at its peak (activations, gradients, optimizer state, comm buffers); and the wall time
and the process's CPU time of the quickest iteration after the first (a warm-up).
A second, profiled run of the same job gives *alloc*: the peak of the bytes torch's CPU
allocator held from the trainer's build on (:func:`alloc_peak_rank`; the CPU's counterpart of
``torch.cuda.max_memory_allocated``: tensors only, no torch import, no heap slack).
Ratios are to cp = 1 at the same sequence length. The processes share the machine's cores, so
wall times are only as quiet as the machine; on a loaded machine the CPU time is the steadier
figure (cp = 2 runs two processes, which a per-session fair share does not give twice the CPU).

**Saved activations** (``--no-saved`` skips this and the bytes). For cp = 1, 2, 4 (both
``cp_comm_type`` for cp > 1) a seq-1024 model runs the forward (and loss) of one microbatch
under ``torch.autograd.graph.saved_tensors_hooks``; the pack hook records every tensor
autograd saves for backward, each storage once (views share their storage), parameters and
buffers excluded. Nothing saved is freed before backward, so the sum at the end of the
forward is the peak saved-activation footprint, exactly and deterministically. It is split
into the attention core (inside ``context_parallel_attention``) and everything else, with
its ratio to cp = 1 and the ideal ``1/cp``. Every path now runs fused kernels that save only
q, k, v, the output and the log-sum-exp (the all-gather variant saves the gathered K/V
instead of the local ones), so no ``[s_q, s_k]`` tensor is saved anywhere. A storage saved
in both places counts where it was saved first.

**Bytes.** The same runs then train two iterations and the CP traffic of the second is
compared with the analytic minimum of :mod:`comm_bench` (``3 (cp-1)`` K/V blocks per layer per
microbatch for the ring, ``2 (cp-1)`` for all-gather), and an MoE variant of the model does
the same for EP = 2, 4 (routed token rows, from the actual routing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


from bench.comm_attribution import measure_trainer  # noqa: E402
from bench.comm_bench import Layout, compare, header, layout_job, print_table  # noqa: E402
from workers.config import JobConfig  # noqa: E402

LONG_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 128, "vocab_size": 256, "seq_length": 1024}
MIB = 2**20


def cp_layout(cp: int, comm_type: str = "p2p") -> Layout:
    return Layout(f"cp{cp}-{comm_type}", {"context_parallel_size": cp, "cp_comm_type": comm_type})


def long_job(layout: Layout, world: int, global_batch: int = 1) -> JobConfig:
    return layout_job(layout, world, model=LONG_MODEL,
                      training={"global_batch_size": global_batch, "micro_batch_size": 1})


def saved_activation_bytes(trainer) -> dict[str, int]:
    """Bytes autograd saves for backward during the forward + loss of microbatch 0.

    Returns ``{"attention": ..., "other": ..., "total": ...}``; each storage counted once,
    parameters and buffers excluded.
    """
    import torch

    import workers.model.decoder as model_module
    from workers.parallel.cross_entropy import vocab_parallel_cross_entropy

    assert len(trainer.chunks) == 1 and trainer.grid.pp == 1, "one stage holding the whole model"
    chunk = trainer.chunks[0]
    static = {t.untyped_storage().data_ptr() for t in list(chunk.parameters()) + list(chunk.buffers())}
    seen: dict[int, tuple[int, str]] = {}
    where = {"in": "other"}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in static and key not in seen:
            seen[key] = (storage.nbytes(), where["in"])
        return t

    original = model_module.context_parallel_attention

    def attention(*args, **kwargs):
        where["in"] = "attention"
        try:
            return original(*args, **kwargs)
        finally:
            where["in"] = "other"

    model_module.context_parallel_attention = attention
    try:
        tokens, labels = trainer._microbatch(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = chunk(tokens)
            loss = vocab_parallel_cross_entropy(logits, labels, trainer.groups.tp_group).sum()
        del logits, loss  # drop the graph (and what it saved) without a backward
    finally:
        model_module.context_parallel_attention = original
    out = {"attention": 0, "other": 0}
    for nbytes, kind in seen.values():
        out[kind] += nbytes
    out["total"] = out["attention"] + out["other"]
    return out


def memory_and_bytes_rank(rank: int, world_size: int, job: JobConfig) -> dict:
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world_size)
    memory = saved_activation_bytes(trainer) if not job.model.is_moe else {}
    return {**measure_trainer(trainer), "memory": memory}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rank(rank: int, world_size: int, job: JobConfig, iters: int) -> dict:
    """Build the trainer, train ``iters`` iterations; the process's memory and step times."""
    from workers.train.trainer import Trainer

    trainer = Trainer(job, rank, world_size)
    built_kb = _status_kb("VmRSS")
    steps, cpu = [], []
    for _ in range(iters):
        c0 = time.process_time()
        steps.append(trainer.train_step()["step_time_s"])
        cpu.append(time.process_time() - c0)
    # The first iteration warms up; of the others the quickest is the least disturbed by load.
    timed = slice(1, None) if iters > 1 else slice(None)
    return {"hwm_kb": _status_kb("VmHWM"), "built_kb": built_kb, "step": min(steps[timed]), "cpu": min(cpu[timed])}


def alloc_peak_rank(rank: int, world_size: int, job: JobConfig, iters: int) -> int:
    """The peak of the bytes torch's CPU allocator held from the trainer's build to the end of
    ``iters`` iterations: the CPU's ``torch.cuda.max_memory_allocated``. Every allocation and free
    torch makes is a ``[memory]`` event of the profiler (``profile_memory``), started before the
    trainer is built so that nothing it frees was allocated unseen; the running sum of their sizes
    in time order peaks at the answer. What is not a tensor (the torch import, Python objects,
    gloo's own buffers) is not counted."""
    from torch.profiler import ProfilerActivity, profile

    from workers.train.trainer import Trainer

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(job, rank, world_size)
        for _ in range(iters):
            trainer.train_step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def long_corpus(seq_len: int, directory: str) -> str:
    """A token file long enough for ``seq_len`` (the built-in text, repeated): builtin:tiny has
    5,002 tokens and the train split must hold a whole sample."""
    import numpy as np

    from workers.data.corpus import load_tokens

    tiny = load_tokens("builtin:tiny")
    path = os.path.join(directory, f"tiny-x{seq_len}.npy")
    np.save(path, np.resize(tiny, 2 * seq_len + 2).astype(np.uint16))
    return path


def peak_and_time(seqs, iters: int, all_gather: bool) -> None:
    """The side-by-side table of peak memory and step time, cp 1 against cp 2."""
    import tempfile

    from tests.helpers.ranks import run_ranks

    tmp = tempfile.TemporaryDirectory(prefix="cp_memory-")
    print(f"\npeak memory and step time per rank (max over ranks), {iters} iterations, the quickest after the "
          f"first reported; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'seq':>6} {'cp':>3} {'comm':<11} {'VmHWM':>8} {'built':>7} {'added':>7} {'alloc':>7} {'step s':>7} "
          f"{'cpu s':>6} {'run s':>6} {'HWM/cp1':>8} {'added/cp1':>9} {'alloc/cp1':>9} {'step/cp1':>8} {'cpu/cp1':>7}")
    for seq in seqs:
        layouts = [(cp_layout(1), 1), (cp_layout(2), 2)] + ([(cp_layout(2, "all_gather"), 2)] if all_gather else [])
        base = None
        for layout, world in layouts:
            job = layout_job(layout, world, model={**LONG_MODEL, "seq_length": seq},
                             training={"global_batch_size": 1, "micro_batch_size": 1, "train_iters": iters,
                                       "data": long_corpus(seq, tmp.name)})
            t0 = time.perf_counter()
            results = run_ranks(peak_rank, world, args=(job, iters), timeout_s=1800)
            run_s = time.perf_counter() - t0
            alloc = max(run_ranks(alloc_peak_rank, world, args=(job, iters), timeout_s=1800)) / MIB
            row = {"hwm": max(r["hwm_kb"] for r in results) / 1024, "alloc": alloc,
                   "built": max(r["built_kb"] for r in results) / 1024,
                   "added": max(r["hwm_kb"] - r["built_kb"] for r in results) / 1024,
                   "step": max(r["step"] for r in results), "cpu": max(r["cpu"] for r in results)}
            base = base or row
            comm_type = job.parallel.cp_comm_type if world > 1 else "-"
            print(f"{seq:>6} {world:>3} {comm_type:<11} {row['hwm']:>8.1f} {row['built']:>7.1f} {row['added']:>7.1f} "
                  f"{alloc:>7.1f} {row['step']:>7.2f} {row['cpu']:>6.2f} {run_s:>6.1f} {row['hwm'] / base['hwm']:>8.3f} "
                  f"{row['added'] / base['added']:>9.3f} {alloc / base['alloc']:>9.3f} {row['step'] / base['step']:>8.3f} "
                  f"{row['cpu'] / base['cpu']:>7.3f}", flush=True)
    tmp.cleanup()
    print("(MiB; VmHWM: the process's peak resident set; built: resident once the trainer is built; "
          "added: VmHWM - built; alloc: the peak of torch's CPU allocator from the build on (a separate, "
          "profiled run); step s: wall, cpu s: the process's CPU time, of one iteration; "
          "run s: the whole run, process start included)")


def run(layout: Layout, world: int, global_batch: int = 1):
    from tests.helpers.ranks import run_ranks

    job = long_job(layout, world, global_batch)
    results = run_ranks(memory_and_bytes_rank, world, args=(job,), timeout_s=300)
    return job, results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384", help="sequence lengths of the peak/time table")
    parser.add_argument("--iters", type=int, default=3,
                        help="iterations per run; the quickest after the first is reported")
    parser.add_argument("--all-gather", action="store_true", help="add cp 2 with cp_comm_type all_gather")
    parser.add_argument("--no-saved", action="store_true", help="skip the saved-activation and bytes tables")
    parser.add_argument("--quick", action="store_true", help="seq 8192 only, no saved-activation / bytes tables")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    m = LONG_MODEL
    print(f"model: {m['num_layers']} layers, h {m['hidden_size']}, heads {m['num_attention_heads']} "
          f"(kv {m['num_query_groups']}), ffn {m['ffn_hidden_size']}, micro batch 1, fp32")
    seqs = [8192] if args.quick else [int(x) for x in args.seqs.split(",") if x]
    peak_and_time(seqs, args.iters, args.all_gather)
    if args.quick or args.no_saved:
        print(f"({time.perf_counter() - t0:.0f} s)")
        return
    print(f"\nseq {m['seq_length']} from here on")
    runs = [(cp_layout(1), 1)] + [(cp_layout(cp, ct), cp) for cp in (2, 4) for ct in ("p2p", "all_gather")]
    outputs = [(layout, *run(layout, world)) for layout, world in runs]

    print("\nsaved activations of one microbatch's forward + loss, per rank (max over ranks), MiB")
    print(f"{'cp':>3} {'comm':<11} {'total':>8} {'attn core':>10} {'other':>8} {'total/cp1':>10} "
          f"{'other/cp1':>10} {'ideal':>6}")
    base = None
    for layout, job, results in outputs:
        cp = job.parallel.context_parallel_size
        mem = {k: max(r["memory"][k] for r in results) for k in ("total", "attention", "other")}
        base = base or mem
        comm_type = job.parallel.cp_comm_type if cp > 1 else "-"
        print(f"{cp:>3} {comm_type:<11} {mem['total'] / MIB:>8.2f} {mem['attention'] / MIB:>10.2f} "
              f"{mem['other'] / MIB:>8.2f} {mem['total'] / base['total']:>10.3f} "
              f"{mem['other'] / base['other']:>10.3f} {1 / cp:>6.3f}")

    print("\nCP and EP bytes of one iteration (second of two) vs the analytic minimum")
    header()
    for layout, job, results in outputs[1:]:
        rows = [r for r in compare(job, results) if r.traffic == "cp"]
        print_table(f"{layout.name} s{m['seq_length']}", rows)
    for ep in (2, 4):
        layout = Layout(f"ep{ep}-moe", {"expert_model_parallel_size": ep}, moe=True)
        job, results = run(layout, ep, global_batch=ep)
        rows = [r for r in compare(job, results) if r.traffic in ("ep", "grads:dense", "grads:expert")]
        print_table(f"{layout.name} s{m['seq_length']}", rows)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
