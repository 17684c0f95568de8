"""Issue 23's acceptance figures for the auto layout, on CPU: the cost model's memory against the
measured peak, and its step-time ranking against measured step times, with ``--trial 4``'s pick.

    .venv/bin/python -m bench.auto_layout_bench              # both parts
    .venv/bin/python -m bench.auto_layout_bench --memory     # memory only (~2 min on 2 cores)
    .venv/bin/python -m bench.auto_layout_bench --time       # timing only (~5 min on 2 cores)

**Memory** (:func:`memory_table`). One model (8 layers, h 512, vocab 8192: 42 M parameters, fp32,
seq 256, micro batch 2, global batch 8; ``--small-model``: the earlier 4 layers, h 256, 5 M
parameters, where the per-process costs below weigh more than the model) in 6 layouts of 4 ranks
(2 nodes x 2). Each rank is a process of
:func:`tests.helpers.ranks.run_ranks`; *measured peak* = the process's ``VmHWM`` after 3 iterations
minus its ``VmRSS`` just before the trainer is built (the torch import and the process group are
there already: about 0.2-0.3 GB that no layout changes and the cost model does not count). The
largest rank's is set beside the plan's ``peak_bytes_per_rank`` (the most loaded rank: weights,
gradients, Adam state and activations, and on the simulated CPU cluster what a rank process holds
whatever the model, ``process_mb`` of :data:`service.spec.cost.CPU_FIGURES`; :mod:`service.spec.cost`).
*fixed* measures that last part again: the same layout with a negligible model.

**Time** (:func:`time_table`). A model whose layouts differ (8 layers, h 256, seq 256, global
batch 16) on a 2 x 4 cluster of local processes (the simulated CPU cluster; ``--ray`` runs it on
``--simulate 2x4``): 8 hand-picked layouts each run ``--iters`` iterations as trials of
:mod:`service.control.trials` (median after the warm-up, slowest rank); the cost model's
predicted ranking of the 8 against the measured one (Spearman's rho), then ``plan --auto
--trial 4`` (the model's top 4 of the whole search, trialled) and its pick's measured time
against the fastest of the 8. The model uses the simulated CPU cluster's stored figures
(``gpu_type: cpu``: :data:`service.spec.cost.CPU_FIGURES`, ranks sharing the machine's cores,
:mod:`service.spec.cost_cpu`); the bench measures them again first (:mod:`bench.cpu_calibrate`)
and prints both, so a drift of the machine shows. The processes share the machine's cores (and,
on a shared dev machine, other people's work): the timings are only as quiet as the machine; the
load average is printed beside each.
"""

from __future__ import annotations

import argparse
import os
import sys


MEMORY_MODEL = {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4,
                "ffn_hidden_size": 2048, "vocab_size": 8192, "seq_length": 256}
SMALL_MEMORY_MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
                      "ffn_hidden_size": 1024, "vocab_size": 2048, "seq_length": 256}
MEMORY_LAYOUTS = {
    "dp4": {},
    "dp4+distopt": {"use_distributed_optimizer": True},
    "tp2+sp dp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2 dp2": {"pipeline_model_parallel_size": 2},
    "pp4": {"pipeline_model_parallel_size": 4},
    "tp2 pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
}
FIXED_MODEL = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 8, "num_query_groups": 4,
               "ffn_hidden_size": 64, "vocab_size": 256, "seq_length": 32}
TIME_MODEL = {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8, "num_query_groups": 4,
              "ffn_hidden_size": 1024, "vocab_size": 2048, "seq_length": 256}
TIME_LAYOUTS = {
    "dp8": {},
    "tp2 dp4": {"tensor_model_parallel_size": 2},
    "tp4+sp dp2": {"tensor_model_parallel_size": 4, "sequence_parallel": True},
    "pp2 dp4": {"pipeline_model_parallel_size": 2},
    "pp4 dp2": {"pipeline_model_parallel_size": 4},
    "pp8": {"pipeline_model_parallel_size": 8},
    "cp2 dp4": {"context_parallel_size": 2},
    "tp2 pp2 dp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
}


def spec_of(model: dict, parallel: dict, nodes: int, gpus: int, gbs: int, mbs, iters: int = 3,
            resources: dict | None = None) -> dict:
    return {"name": "bench", "model": dict(model), "parallel": parallel,
            "training": {"train_iters": iters, "global_batch_size": gbs, "micro_batch_size": mbs},
            "resources": {"num_nodes": nodes, "gpus_per_node": gpus, **(resources or {})}}


# ----------------------------------------------------------------------------- memory


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_rank(rank: int, world_size: int, job, iters: int) -> dict:
    """VmRSS before the trainer is built, VmHWM after ``iters`` iterations (KiB)."""
    from workers.train.trainer import Trainer

    before = _kb("VmRSS")
    trainer = Trainer(job, rank, world_size)
    for _ in range(iters):
        trainer.train_step()
    return {"before_kb": before, "hwm_kb": _kb("VmHWM")}


def _measured_and_plan(model: dict, par: dict, iters: int) -> tuple[float, dict]:
    from service.spec.plan import plan_job
    from service.spec.spec import parse_spec, to_job_config
    from tests.helpers.ranks import run_ranks

    spec = parse_spec(spec_of(model, par, 2, 2, 8, 2, iters))
    out = run_ranks(memory_rank, 4, args=(to_job_config(spec), iters), timeout_s=900)
    return max((r["hwm_kb"] - r["before_kb"]) * 1024 for r in out), plan_job(spec)["cost"]


def _allocator_peak(model: dict, par: dict, iters: int) -> float:
    """The largest rank's peak of torch's CPU allocator over the build and ``iters`` iterations
    (:func:`bench.cp_memory.alloc_peak_rank`: tensors only, whatever the C heap keeps)."""
    from bench.cp_memory import alloc_peak_rank
    from service.spec.spec import parse_spec, to_job_config
    from tests.helpers.ranks import run_ranks

    spec = parse_spec(spec_of(model, par, 2, 2, 8, 2, iters))
    return float(max(run_ranks(alloc_peak_rank, 4, args=(to_job_config(spec), iters), timeout_s=900)))


def memory_table(iters: int = 3, model: dict | None = None) -> list[dict]:
    model = model or MEMORY_MODEL
    print(f"\nmemory: plan vs measured peak per rank, {len(MEMORY_LAYOUTS)} layouts of 4 ranks (2 x 2), "
          f"fp32, {iters} iterations; measured = VmHWM - VmRSS before the trainer (the largest rank); "
          f"fixed = the same for the same layout of a negligible model (h 32, seq 32, vocab 256); "
          f"net = measured - fixed, beside the plan's difference of the two models; alloc = the peak of torch's "
          f"CPU allocator (a profiled run: tensors only), beside the plan's state + activations")
    print(f"{'layout':<14} {'state MB':>9} {'act MB':>7} {'plan MB':>8} {'measured':>9} {'plan/meas':>10} "
          f"{'fixed':>6} {'net meas':>9} {'net plan':>9} {'net p/m':>8} {'alloc':>7} {'s+a/alloc':>9}")
    rows = []
    for name, par in MEMORY_LAYOUTS.items():
        measured, cost = _measured_and_plan(model, par, iters)
        fixed, fixed_cost = _measured_and_plan(FIXED_MODEL, par, iters)
        alloc = _allocator_peak(model, par, iters)
        row = {"layout": name, "state": cost["state_bytes"]["total"], "activations": cost["activation_bytes"]["total"],
               "alloc": alloc,
               "plan": cost["peak_bytes_per_rank"], "measured": measured, "fixed": fixed,
               "net_measured": measured - fixed, "net_plan": cost["peak_bytes_per_rank"] - fixed_cost["peak_bytes_per_rank"]}
        rows.append(row)
        print(f"{name:<14} {row['state'] / 1e6:>9.1f} {row['activations'] / 1e6:>7.1f} {row['plan'] / 1e6:>8.1f} "
              f"{measured / 1e6:>9.1f} {row['plan'] / measured:>10.3f} {fixed / 1e6:>6.1f} "
              f"{row['net_measured'] / 1e6:>9.1f} {row['net_plan'] / 1e6:>9.1f} "
              f"{row['net_plan'] / row['net_measured']:>8.3f} {alloc / 1e6:>7.1f} "
              f"{(row['state'] + row['activations']) / alloc:>9.3f}", flush=True)
    worst = max(abs(r["plan"] / r["measured"] - 1) for r in rows)
    worst_net = max(abs(r["net_plan"] / r["net_measured"] - 1) for r in rows)
    worst_alloc = max(abs((r["state"] + r["activations"]) / r["alloc"] - 1) for r in rows)
    print(f"largest |plan/measured - 1|: {worst:.1%}; net of the fixed cost: {worst_net:.1%}; state + activations "
          f"against the allocator's peak: {worst_alloc:.1%} (acceptance: <= 15%)")
    return rows


# ----------------------------------------------------------------------------- time


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def time_table(iters: int, ray: bool) -> dict:
    from service.control.trials import run_trial, run_trials
    from service.ranks.launcher import open_launcher
    from service.spec.plan import plan_job
    from service.spec.spec import parse_spec, search_layouts

    from bench.cpu_calibrate import calibrate
    from service.spec.cluster_figures import CPU_FIGURES

    now = calibrate()
    print(f"\nthe simulated CPU cluster's figures (service/spec/cluster_figures.py CPU_FIGURES, what the model uses): "
          f"{CPU_FIGURES}\nmeasured now by bench/cpu_calibrate.py (8 ranks on {os.cpu_count()} cores): {now}")
    res = {"gpu_type": "cpu"}
    rows = []
    with open_launcher("ray" if ray else "processes", shape=(2, 4), simulate=(2, 4) if ray else None) as launcher:
        print(f"time: {len(TIME_LAYOUTS)} layouts on 2 x 4 ({'Ray --simulate 2x4' if ray else 'local processes'}), "
              f"{iters} iterations each, median after the first, slowest rank; load {os.getloadavg()[0]:.1f}")
        print(f"{'layout':<14} {'pred s':>8} {'meas s':>8} {'load':>5}")
        for name, par in TIME_LAYOUTS.items():
            data = spec_of(TIME_MODEL, par, 2, 4, 16, 1, iters, res)
            pred = plan_job(parse_spec(data))["cost"]["predicted_step_s"]
            m = run_trial(launcher, data, iters, f"bench-{len(rows)}")
            rows.append({"layout": name, "predicted": pred, "measured": m.get("measured_step_s", float("inf"))})
            print(f"{name:<14} {pred:>8.4f} {rows[-1]['measured']:>8.4f} {os.getloadavg()[0]:>5.1f}", flush=True)
        rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
        fastest = min(rows, key=lambda r: r["measured"])
        slowest = max(rows, key=lambda r: r["measured"])
        print(f"spread: slowest / fastest = {slowest['measured'] / fastest['measured']:.2f}x (needs >= 1.5x); "
              f"Spearman rho(predicted, measured) = {rho:.3f} (acceptance: >= 0.7)")
        auto = spec_of(TIME_MODEL, "auto", 2, 4, 16, 1, iters, res)
        found = run_trials(search_layouts(auto), 4, launcher, iterations=iters,
                           note=lambda line: print(f"  {line}", flush=True))
    win = found["candidates"][0]
    s = win["sizes"]
    ratio = win["measured_step_s"] / fastest["measured"]
    print(f"--auto --trial 4 picks tp {s['tp']} pp {s['pp']} vpp {s['vpp'] or '-'} cp {s['cp']} dp {s['dp']} "
          f"mbs {win['micro_batch_size']}: {win['measured_step_s']:.4f} s measured in its trial = {ratio:.3f} x the "
          f"fastest of the 8 ({fastest['layout']}, {fastest['measured']:.4f} s) (acceptance: <= 1.10)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return {"rows": rows, "spearman": rho, "pick_ratio": ratio, "calibration": now}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory", action="store_true", help="the memory part only")
    p.add_argument("--time", action="store_true", help="the timing part only")
    p.add_argument("--small-model", action="store_true", help="memory: the 5 M-parameter model")
    p.add_argument("--iters", type=int, default=4, help="iterations per timed layout (default 4)")
    p.add_argument("--ray", action="store_true", help="time on Ray --simulate 2x4 instead of local processes")
    args = p.parse_args(argv)
    both = not (args.memory or args.time)
    if args.memory or both:
        # What the tensors need, not the heap's slack: every block of 128 KiB or more mmapped in the
        # rank processes (workers/train/heap.py; opt-in, it costs step time).
        os.environ.setdefault("RAYTRON_MMAP_THRESHOLD", str(128 * 1024))
        memory_table(model=SMALL_MEMORY_MODEL if args.small_model else MEMORY_MODEL)
    if args.time or both:
        time_table(args.iters, args.ray)
    return 0


if __name__ == "__main__":
    sys.exit(main())
