"""``raytron plan --auto SPEC``: the cost model's best layouts for a spec, as a table or JSON.

The search is :func:`service.spec.spec.search_layouts` (``parallel: auto`` and the other ``auto``
fields; a spec with none open is searched with its whole parallel section open). ``--json`` prints
``{"candidates": [{"sizes": {"tp", "pp", "vpp", "cp", "ep", "dp"}, "order", "micro_batch_size",
"use_distributed_optimizer", "recompute_granularity", "predicted_step_s", "peak_bytes_per_rank", ...}],
"chosen": 0, ...}``.

``--trial K`` then runs each of the top K for a few iterations (:mod:`service.control.trials`) on
``--launcher`` (local processes by default; ``ray``, with ``--simulate NODESxGPUS`` a simulated
cluster), ranks them by measured step time and prints predicted beside measured; ``--json`` adds
``measured_step_s``, ``measured_peak_bytes``, ``measured_steps_s``, ``losses`` and ``predicted_rank``
to each tried candidate (or ``trial_error``) and ``"trials": K``; ``chosen`` (0) is the winner.
"""

from __future__ import annotations

import argparse
import sys

from api.cli.arg_types import positive, simulate

GB = 1e9


def add_trial_args(p: argparse.ArgumentParser, *, launcher: bool) -> None:
    """``--trial K`` and ``--trial-iters N`` (``raytron plan --auto`` and ``raytron run``); with
    ``launcher``, ``--launcher`` and ``--simulate`` too (``raytron run`` has its own)."""
    p.add_argument("--trial", type=positive, default=None, metavar="K",
                   help="run each of the cost model's top K layouts for a few iterations, measure step time and "
                        "peak memory, and rank them by the measured time (parallel: auto)")
    p.add_argument("--trial-iters", type=positive, default=None, metavar="N",
                   help="iterations per trial, the first a warm-up (default 3)")
    if launcher:
        from service.ranks.launcher import LAUNCHERS

        p.add_argument("--launcher", choices=LAUNCHERS, default=None,
                       help="where trials run: local processes (default) or Ray actors")
        p.add_argument("--simulate", type=simulate, default=None, metavar="NODESxGPUS",
                       help="trials on a local simulated Ray cluster of that shape")


def print_auto(found: dict, out=None) -> None:
    out = out or sys.stdout
    cl = found["cluster"]
    print(f"parallel: auto on {cl['name']} ({cl['memory_gb']:g} GB, {cl['peak_tflops']:g} TFLOP/s, "
          f"{cl['intra_node_bandwidth_gbps']:g} GB/s in a node, {cl['inter_node_bandwidth_gbps']:g} GB/s across): "
          f"{found['considered']} layouts x micro batches, {found['valid']} valid, {found['fit']} with their optimizer "
          f"and recompute choices fit {found['memory_limit_bytes'] / GB:.1f} GB; open: {', '.join(found['open'])}",
          file=out)
    print(f"{'#':>2} {'tp':>3}{'pp':>3}{'vpp':>4}{'cp':>3}{'ep':>3}{'dp':>3} {'sp':>3}{'mbs':>4} {'dist':>5} {'recomp':>7}"
          f" {'step s':>7} {'peak GB':>8} {'act GB':>7} {'bubble s':>9} {'comm s':>7} {'x-node GB':>10}", file=out)
    for i, c in enumerate(found["candidates"]):
        s, t = c["sizes"], c["step_seconds"]
        comm = t["tp"] + t["cp"] + t["ep"] + t["pp"] + t["dp_exposed"]
        mark = "*" if i == found["chosen"] else " "
        print(f"{i:>2}{mark}{s['tp']:>3}{s['pp']:>3}{s['vpp'] or '-':>4}{s['cp']:>3}{s['ep']:>3}{s['dp']:>3} "
              f"{'y' if c['sequence_parallel'] else 'n':>3}{c['micro_batch_size']:>4} "
              f"{'y' if c['use_distributed_optimizer'] else 'n':>5} {c['recompute_granularity'] or '-':>7}"
              f" {c['predicted_step_s']:>7.3f} {c['peak_bytes_per_rank'] / GB:>8.1f} {c['activation_bytes'] / GB:>7.1f}"
              f" {c['bubble_s']:>9.3f} {comm:>7.3f} {c['cross_node_bytes'] / GB:>10.1f}", file=out)
    print("* chosen. peak = weights + grads + optimizer + activations of the most loaded rank; comm = TP, CP, EP, "
          "PP and the DP time not hidden by backward; x-node = bytes per iteration crossing nodes, all ranks",
          file=out)


def print_cost(plan: dict, out=None) -> None:
    """The cost-model lines of ``raytron plan`` (the ``cost`` part of :func:`service.spec.plan.plan_job`)."""
    out = out or sys.stdout
    c = plan.get("cost")
    if not c:
        return
    t = c["step_seconds"]
    print(f"cost model ({c['cluster']['name']}): peak {c['peak_bytes_per_rank'] / GB:.1f} GB per rank "
          f"(state {c['state_bytes']['total'] / GB:.1f} + activations {c['activation_bytes']['total'] / GB:.1f}"
          + (f" + process {c['process_bytes'] / GB:.2f}" if c.get("process_bytes") else "") + "), "
          f"{'fits' if c['fits'] else 'does NOT fit'} {c['cluster']['memory_gb']:g} GB x {c['memory_margin']}; "
          f"step {c['predicted_step_s']:.3f} s = " + " + ".join(
              f"{k} {t[k]:.3f}" for k in ("compute", "recompute", "tp", "cp", "ep", "pp", "bubble", "dp_exposed",
                                         "optimizer") if t.get(k)), file=out)


def trial_args_problem(args, *, auto: bool, trial_launcher: bool) -> str:
    """Why the trial flags given do not go together ("" when they do): nothing is accepted and ignored.
    ``auto``: ``--auto`` given (``raytron run``: True); ``trial_launcher``: ``--launcher`` and
    ``--simulate`` are the trials' only (``raytron plan``; ``raytron run``'s are the job's)."""
    if getattr(args, "trial", None) and not auto:
        return f"--trial {args.trial} ranks the layouts of --auto: add --auto"
    if getattr(args, "trial_iters", None) and not getattr(args, "trial", None):
        return f"--trial-iters {args.trial_iters} is the length of each trial: add --trial K"
    if trial_launcher:
        for flag in ("launcher", "simulate"):
            if getattr(args, flag, None) is not None and not getattr(args, "trial", None):
                return f"--{flag} is where trials run: add --auto --trial K"
    return ""


def print_trials(found: dict, out=None) -> None:
    """The trials' table: predicted beside measured, in measured order (``raytron plan --auto --trial K``)."""
    out = out or sys.stdout
    print(f"trials: {found['trials']} layouts, ranked by measured step time (the median after a warm-up "
          f"iteration, slowest rank); peak = the largest rank's", file=out)
    print(f"{'#':>2} {'model#':>6} {'tp':>3}{'pp':>3}{'vpp':>4}{'cp':>3}{'ep':>3}{'dp':>3} {'mbs':>4} "
          f"{'pred s':>8} {'meas s':>8} {'pred GB':>8} {'meas GB':>8}", file=out)
    for i, c in enumerate(found["candidates"][:found["trials"]]):
        s = c["sizes"]
        mark = "*" if i == found["chosen"] else " "
        ok = c.get("measured_step_s") is not None
        step = f"{c['measured_step_s']:.4g}" if ok else "failed"
        peak = f"{c['measured_peak_bytes'] / GB:.3g}" if ok else "-"
        print(f"{i:>2}{mark}{c['predicted_rank']:>6} {s['tp']:>3}{s['pp']:>3}{s['vpp'] or '-':>4}{s['cp']:>3}"
              f"{s['ep']:>3}{s['dp']:>3} {c['micro_batch_size']:>4} {c['predicted_step_s']:>8.4g} {step:>8} "
              f"{c['peak_bytes_per_rank'] / GB:>8.3g} {peak:>8}", file=out)
        if c.get("trial_error"):
            print(f"   error: {c['trial_error']}", file=out)


def trials_of(spec_data: dict, found: dict, args, note=None) -> dict:
    """``found`` re-ranked by trials of its top ``args.trial`` on the launcher the args name."""
    from service.control.trials import TRIAL_ITERATIONS, run_trials
    from service.ranks.launcher import open_launcher

    from service.spec.stored import stored_section

    res = stored_section(spec_data, "resources")
    note = note or (lambda line: print(f"raytron: {line}", file=sys.stderr))
    with open_launcher(args.launcher or "processes", shape=(res.num_nodes, res.gpus_per_node),
                       simulate=args.simulate, note=note) as launcher:
        return run_trials(found, args.trial, launcher, iterations=args.trial_iters or TRIAL_ITERATIONS, note=note)


def run_auto(spec_data, args, bad_input: type[Exception], print_json) -> int:
    """``raytron plan --auto [--trial K]``: computed here (a ``--server`` is not asked); bad input raises
    ``bad_input``; trials run on ``--launcher`` (processes by default)."""
    from service.spec.check import check_spec
    from service.spec.spec import search_layouts

    if not isinstance(spec_data, dict):
        raise bad_input(f"a job spec is a mapping of sections, got {type(spec_data).__name__}")
    check = check_spec(spec_data)
    if check.problems:
        raise bad_input("invalid job spec: " + "; ".join(f"{p['field']}: {p['message']}" for p in check.problems))
    try:
        found = search_layouts(spec_data)
    except ValueError as e:
        raise bad_input(str(e)) from None
    if getattr(args, "trial", None):
        found = trials_of(spec_data, found, args)
    for c in found["candidates"]:
        c.pop("data", None)
    if args.json:
        print_json(found)
        return 0
    print_auto(found)
    if found.get("trials"):
        print_trials(found)
    return 0
