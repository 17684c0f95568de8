"""The ``raytron`` command line (ARCHITECTURE.md contract 3).

Invalid input exits with status 2 and one clear line on stderr. Heavy imports (torch, ray)
happen only inside the sub-commands that need them, so ``raytron grid`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys

EXAMPLES = """\
examples:
  raytron grid --world-size 16 --tp 2 --pp 2 --cp 2 --json
  raytron run examples/tiny-5d.yaml --launcher processes
  raytron run examples/tiny-5d.yaml --simulate 2x4
"""


class UsageError(Exception):
    """Bad input from the user: exit status 2 with one line on stderr."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message by default)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _simulate(text: str) -> tuple[int, int]:
    try:
        nodes, gpus = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NODESxGPUS such as 2x4, got {text!r}") from None
    if nodes < 1 or gpus < 1:
        raise argparse.ArgumentTypeError(f"expected positive NODESxGPUS such as 2x4, got {text!r}")
    return nodes, gpus


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="raytron",
        description="raytron: Megatron-style 5D-parallel training on Ray (TP+SP, PP, DP, CP, EP).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    g = sub.add_parser(
        "grid",
        help="show the rank grid, process groups and placement for a parallel layout",
        description="Print each rank's coordinates and node, and every process group Megatron-Core "
        "would create, for a world size and parallel sizes. Runs nothing.",
    )
    g.add_argument("--world-size", type=_positive, required=True, help="number of ranks (GPUs)")
    g.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=_positive, default=1,
                   help="tensor parallel size (default 1)")
    g.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=_positive, default=1,
                   help="pipeline parallel size (default 1)")
    g.add_argument("--context-parallel-size", "--cp", dest="cp", type=_positive, default=1,
                   help="context parallel size (default 1)")
    g.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=_positive, default=1,
                   help="expert parallel size (default 1)")
    g.add_argument("--expert-tensor-parallel-size", "--etp", dest="etp", type=_positive, default=None,
                   help="expert tensor parallel size (default: the tensor parallel size)")
    g.add_argument("--virtual-pipeline-model-parallel-size", "--vpp", dest="vpp", type=_positive,
                   default=None, help="model chunks per pipeline stage (interleaved schedule)")
    g.add_argument("--order", default="tp-cp-ep-dp-pp",
                   help="axes from fastest- to slowest-varying rank (default tp-cp-ep-dp-pp)")
    g.add_argument("--gpus-per-node", type=_positive, default=8,
                   help="GPUs per node for the placement plan (default 8)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    g.set_defaults(func=cmd_grid)

    r = sub.add_parser(
        "run",
        help="run a training job (spec YAML/JSON) and wait for it",
        description="Validate a job spec, place its ranks and train. With --launcher ray (default) "
        "the ranks are Ray actors (RAY_ADDRESS, or an embedded local cluster); with --launcher "
        "processes they are local processes (no Ray).",
    )
    r.add_argument("spec", help="job spec file (YAML or JSON)")
    r.add_argument("--launcher", choices=("ray", "processes"), default="ray",
                   help="how ranks are started (default ray)")
    r.add_argument("--simulate", type=_simulate, default=None, metavar="NODESxGPUS",
                   help="start a local simulated Ray cluster of NODES nodes with GPUS fake GPU slots each")
    r.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")
    r.set_defaults(func=cmd_run)
    return parser


def grid_report(grid, gpus_per_node: int) -> dict:
    """The ``raytron grid --json`` object (contract 3)."""
    from service.placement import plan_placement
    from workers.grid import DECODER_KINDS, EXPERT_KINDS

    plan = plan_placement(grid, gpus_per_node)
    ranks = []
    for r in range(grid.world_size):
        c = grid.coords(r)
        ranks.append({"rank": r, "tp": c["tp"], "cp": c["cp"], "dp": c["dp"], "pp": c["pp"], "ep": c["ep"],
                      "etp": c["etp"], "expert_dp": c["expert_dp"], "node": plan[r].node, "local": plan[r].local})
    return {
        "world_size": grid.world_size,
        "sizes": grid.sizes(),
        "decoder": {k: grid.groups(k) for k in DECODER_KINDS},
        "expert": {k: grid.groups(k, expert=True) for k in EXPERT_KINDS},
        "embedding": grid.embedding_groups(),
        "position_embedding": grid.position_embedding_groups(),
        "ranks": ranks,
    }


def _fmt_groups(groups: list[list[int]], limit: int = 8) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def print_grid(report: dict, order: str, out=sys.stdout, max_rows: int = 64) -> None:
    s = report["sizes"]
    print(f"world_size {report['world_size']}  order {order}  " +
          "  ".join(f"{k} {v}" for k, v in s.items()), file=out)
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


def cmd_grid(args) -> int:
    from workers.grid import ParallelGrid

    try:
        grid = ParallelGrid(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                            etp=args.etp, vpp=args.vpp, order=args.order)
        report = grid_report(grid, args.gpus_per_node)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        json.dump(report, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
    else:
        print_grid(report, grid.order)
    return 0


def cmd_run(args) -> int:
    from service.runner import run_from_cli

    return run_from_cli(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except UsageError as e:
        print(f"raytron {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
