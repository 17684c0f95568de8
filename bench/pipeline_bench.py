"""Pipeline bubble and step time of 1F1B, interleaved, ZB-H1 and ZBV at pp 4, side by side.

Four local rank processes (gloo, CPU, one thread each) run each schedule's tables through the
executor (:func:`workers.parallel.pipeline_exec.run_pipeline`) on a stack of 8 MLP layers
(``h -> 4h -> h`` through :func:`workers.parallel.wgrad.linear`, with ``main_grad`` buffers,
so the zero-bubble schedules defer the weight-gradient GEMMs to their ``W`` steps), with 8 and
16 microbatches. The executor's own timeline gives each action's start and end; per run:

* **step** = first action's start to last action's end over all stages (one clock: one machine);
* **bubble** = 1 - (sum over stages of their actions' time) / (pp x step): the share of the
  stages' time spent waiting (on messages, or with nothing to do).

Four ranks on fewer cores (the 2-core machine of docs/performance.md) time-slice: an action's
wall time includes the time its rank waited for a core, and a stage's pipeline bubble lends its
core to another stage, which blurs both figures. So each run is also **replayed**: every
action's CPU seconds (the timeline's ``cpu``, the thread's own) are put back through the
timed simulator (:func:`workers.parallel.pipeline_check.simulate`), with the schedule's
dependencies, as if each stage had a core of its own: ``bubble*`` and ``step*``.

Each figure is the median of ``--repeats`` runs after one warm-up. Run:
``python -m bench.pipeline_bench`` (a few minutes on 2 cores). The simulator's bubble with
unit F = B = W is printed beside them (``unit``).
"""

from __future__ import annotations

import argparse
import statistics
import time

PP = 4
LAYERS = 8
SCHEDULES = (("1f1b", None), ("interleaved", 2), ("zb-h1", None), ("zbv", 2))
MICROBATCHES = (8, 16)


def _stack(hidden: int, seed: int = 3):
    import torch

    from workers.parallel import wgrad

    class Mlp(torch.nn.Module):
        def __init__(self, g):
            super().__init__()
            self.up = torch.nn.Parameter(torch.randn(4 * hidden, hidden, generator=g) / hidden ** 0.5)
            self.down = torch.nn.Parameter(torch.randn(hidden, 4 * hidden, generator=g) / (4 * hidden) ** 0.5)

        def forward(self, x):
            return wgrad.linear(torch.nn.functional.gelu(wgrad.linear(x, self.up)), self.down, residual=x)

    g = torch.Generator().manual_seed(seed)
    return [Mlp(g) for _ in range(LAYERS)]


def _rank(rank: int, world: int, hidden: int, tokens: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from workers.parallel.data import DataParallelGrads
    from workers.parallel.pipeline import V_SHAPED, partition_layers, schedule
    from workers.parallel.pipeline_check import simulate
    from workers.parallel.pipeline_exec import run_pipeline
    from workers.parallel.pipeline_p2p import plan_all

    torch.set_num_threads(1)
    out = {}
    for m in MICROBATCHES:
        inputs = torch.randn(m, tokens, 1, hidden, generator=torch.Generator().manual_seed(m))
        for name, vpp in SCHEDULES:
            v_shape = name in V_SHAPED
            layers = _stack(hidden)
            mine = partition_layers(LAYERS, PP, vpp, v_shape=v_shape)[rank]
            chunks = [torch.nn.Sequential(*(layers[i] for i in idx)) for idx in mine]
            grads = DataParallelGrads([([p for c in chunks for p in c.parameters()], None)], bucket_size=None)
            tables = [schedule(m, PP, vpp, s, name) for s in range(PP)]
            plan = plan_all(tables, vpp or 1, v_shape)[rank]
            runs = []
            for _ in range(repeats + 1):
                grads.zero()
                timeline: list = []
                dist.barrier()
                run_pipeline(tables[rank], stage=rank, pp=PP, vpp=vpp or 1, pp_ranks=list(range(PP)), chunks=chunks,
                             num_microbatches=m, get_input=lambda mb: inputs[mb],
                             loss_fn=lambda mb, y: (y.float() ** 2).mean() / m, tensor_shape=(tokens, 1, hidden),
                             v_shape=v_shape, plan=plan, timeline=timeline)
                grads.finish()
                everyone = [None] * world
                dist.all_gather_object(everyone, [(start, end, cpu) for *_, start, end, cpu in timeline])
                start = min(s for t in everyone for s, _, _ in t)
                step = max(e for t in everyone for _, e, _ in t) - start
                busy = sum(e - s for t in everyone for s, e, _ in t)
                cpu = [[c for *_, c in t] for t in everyone]
                replay = simulate(tables, vpp or 1, v_shape, durations=cpu)
                runs.append((step, 1 - busy / (PP * step), replay, 1 - sum(map(sum, cpu)) / (PP * replay)))
            grads.remove_hooks()
            runs = runs[1:]  # the warm-up
            out[f"{name}/{m}"] = {key: statistics.median(r[i] for r in runs)
                                  for i, key in enumerate(("step_s", "bubble", "replay_step_s", "replay_bubble"))}
    return out


def simulated_bubble(name: str, vpp: int | None, m: int) -> float:
    """The bubble the timed simulator counts with F = B = W (1F1B and interleaved: B + W as one backward)."""
    from workers.parallel.pipeline_check import check_schedule

    split = name in ("zb-h1", "zbv")
    makespan = check_schedule(m, PP, vpp, name, cost=None if split else {"B": 2})
    return 1 - 3 * m * (vpp or 1) / makespan


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per microbatch")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from tests.helpers.ranks import run_ranks

    began = time.time()
    results = run_ranks(_rank, PP, args=(args.hidden, args.tokens, args.repeats), timeout_s=1800)[0]
    print(f"pp {PP}, {LAYERS} MLP layers h {args.hidden} (4h inner), {args.tokens} tokens per microbatch, fp32, gloo; "
          f"median of {args.repeats} runs ({time.time() - began:.0f} s in all)")
    print(f"{'schedule':<12} {'m':>3} {'bubble':>7} {'step s':>7} {'bubble*':>8} {'step* s':>8} {'vs 1f1b':>8} "
          f"{'unit':>6}")
    for m in MICROBATCHES:
        base = results[f"1f1b/{m}"]["replay_step_s"]
        for name, vpp in SCHEDULES:
            r = results[f"{name}/{m}"]
            print(f"{name:<12} {m:>3} {r['bubble']:>7.3f} {r['step_s']:>7.3f} {r['replay_bubble']:>8.3f} "
                  f"{r['replay_step_s']:>8.3f} {r['replay_step_s'] / base:>8.2f} {simulated_bubble(name, vpp, m):>6.3f}")


if __name__ == "__main__":
    main()
