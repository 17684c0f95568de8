"""Every rank table the CLI prints, one function each, named for its table.

* :func:`print_rank_grid`: ``raytron grid`` (coordinates, nodes and process groups of a layout);
* :func:`print_placement_plan`: ``raytron run``'s plan before launch (node, slot, coordinates);
* :func:`print_reported_placement`: where the ranks report they run (``raytron run``, ``raytron status JOB``);
* :func:`print_job_plan`: ``raytron plan`` (placement, parameters and memory per rank, traffic, cost).
"""

from __future__ import annotations

import sys

from api.rest.placement_view import host_of


def print_rank_grid(report: dict, order: str, out=None, max_rows: int = 64) -> None:
    """``raytron grid``: every rank's coordinates and node, then Megatron-Core's process groups."""
    out = out or sys.stdout
    s = report["sizes"]
    print(f"world_size {report['world_size']}  order {order}  " + "  ".join(f"{k} {v}" for k, v in s.items()),
          file=out)
    cols = ["rank", "node", "local", "tp", "cp", "dp", "pp", "ep", "etp", "expert_dp"]
    print("".join(f"{c:>10}" for c in cols), file=out)
    for row in report["ranks"][:max_rows]:
        print("".join(f"{row[c]:>10}" for c in cols), file=out)
    if len(report["ranks"]) > max_rows:
        print(f"... {len(report['ranks']) - max_rows} more ranks (use --json for all)", file=out)
    print("decoder groups:", file=out)
    for kind, groups in report["decoder"].items():
        print(f"  {kind:<10}{_fmt_groups(groups)}", file=out)
    print("expert groups:", file=out)
    for kind, groups in report["expert"].items():
        print(f"  {kind:<10}{_fmt_groups(groups)}", file=out)
    print(f"  {'embedding':<10}{_fmt_groups(report['embedding'])}", file=out)
    print(f"  {'pos-embed':<10}{_fmt_groups(report['position_embedding'])}", file=out)


def _fmt_groups(groups: list[list[int]], limit: int = 8) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def print_placement_plan(grid, plan, out=None) -> None:
    """``raytron run``'s placement plan (stderr): each rank's node, slot and coordinates before launch."""
    out = out or sys.stderr
    print(f"placement plan: world_size {grid.world_size}, " + " ".join(f"{k}={v}" for k, v in grid.sizes().items()),
          file=out)
    print(f"{'rank':>6}{'node':>6}{'slot':>6}{'tp':>4}{'cp':>4}{'dp':>4}{'pp':>4}{'ep':>4}", file=out)
    for p in plan:
        c = grid.coords(p.rank)
        print(f"{p.rank:>6}{p.node:>6}{p.local:>6}{c['tp']:>4}{c['cp']:>4}{c['dp']:>4}{c['pp']:>4}{c['ep']:>4}",
              file=out)


def print_reported_placement(ranks: list[dict], out=None) -> None:
    """The table of ``raytron run`` (stderr) and ``raytron status JOB``: a rank per line, where it
    runs (:func:`host_of`), its pid and coordinates."""
    out = out or sys.stderr
    print(f"{'rank':>6}  {'node_id/hostname':<20}{'pid':>8}{'tp':>4}{'cp':>4}{'dp':>4}{'pp':>4}{'ep':>4}", file=out)
    for p in ranks:
        print(f"{p['rank']:>6}  {str(host_of(p) or '-')[:18]:<20}{p.get('pid') or '':>8}"
              + "".join(f"{_cell(p.get(k)):>4}" for k in ("tp", "cp", "dp", "pp", "ep")), file=out)


def _cell(value) -> str:
    return "" if value is None else str(value)


def print_job_plan(plan: dict, out=None, max_rows: int = 32) -> None:
    """``raytron plan``: per rank its placement, parameters and state bytes, then traffic and the cost model."""
    out = out or sys.stdout
    s = plan["sizes"]
    print(f"{plan['name']}: world_size {plan['world_size']} on {plan['num_nodes']} node(s) x {plan['gpus_per_node']} "
          f"GPUs, order {plan['order']}; " + " ".join(f"{k}={v}" for k, v in s.items()), file=out)
    print(f"model parameters: {plan['model_parameters']:,}", file=out)
    print(f"{'rank':>6}{'node':>6}{'slot':>6}{'tp':>4}{'cp':>4}{'dp':>4}{'pp':>4}{'ep':>4}{'params':>14}"
          f"{'memory':>12}{'w/ dist-opt':>13}", file=out)
    for p, m in list(zip(plan["placement"], plan["memory"]))[:max_rows]:
        print(f"{p['rank']:>6}{p['node']:>6}{p['local']:>6}" + "".join(f"{p[k]:>4}" for k in ("tp", "cp", "dp", "pp", "ep"))
              + f"{m['parameters']:>14,}{_bytes(m['total_bytes']):>12}{_bytes(m['total_bytes_distributed']):>13}",
              file=out)
    if len(plan["placement"]) > max_rows:
        print(f"... {len(plan['placement']) - max_rows} more ranks (--json for all)", file=out)
    print("memory: weights + gradients + Adam state in the job's precision (activations not included)", file=out)
    print(f"{'traffic/iteration':<20}{'in-node':>14}{'cross-node':>14}", file=out)
    for kind, t in plan["traffic"].items():
        print(f"{kind:<20}{_bytes(t['in_node']):>14}{_bytes(t['cross_node']):>14}", file=out)
    from api.cli.plan_auto import print_cost

    print_cost(plan, out)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
