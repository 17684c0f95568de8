"""The ``raytron`` command line: ``grid``, ``run``, ``serve``, the client of ``serve`` (``submit``,
``status``, ``logs``, ``cancel``, ``plan``), ``export`` and ``preprocess`` (README.md shows each).

Invalid input exits with status 2 and one clear line on stderr. Heavy imports (torch, ray)
happen only inside the sub-commands that need them, so ``raytron grid`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys

from api.cli.arg_types import FAULT_METAVAR, fault, positive as _positive, simulate as _simulate
from api.cli.errors import UsageError
from service.ranks.launcher import LAUNCHERS

EXAMPLES = """\
examples:
  raytron grid --world-size 16 --tp 2 --pp 2 --cp 2 --json
  raytron run examples/tiny-5d.yaml --launcher processes
  raytron run examples/tiny-5d.yaml --simulate 2x4
  raytron run examples/tiny-5d.yaml --launcher processes --fault 1@3:exit
"""



class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message by default)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
    r.add_argument("--launcher", choices=LAUNCHERS, default="ray",
                   help="where the ranks run: local processes, or Ray actors (default ray)")
    r.add_argument("--simulate", type=_simulate, default=None, metavar="NODESxGPUS",
                   help="start a local simulated Ray cluster of NODES nodes with GPUS fake GPU slots each")
    r.add_argument("--fault", type=fault, action="append", metavar=FAULT_METAVAR,
                   help="failure drill (repeatable): RANK raises, its process exits, or it hangs in its next "
                        "collective just before iteration ITER (1-based); save: its process dies in the "
                        "middle of writing the checkpoint of iteration ITER")
    r.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")
    from api.cli.plan_auto import add_trial_args

    add_trial_args(r, launcher=False)  # --trial K: run the fastest of the top K auto layouts
    r.set_defaults(func=cmd_run)

    # light modules: their heavy imports (torch, ray, uvicorn) are inside the commands
    from api.cli import client_cmds, export_cmd, preprocess_cmd, serve_cmd, users_cmds

    serve_cmd.add_parser(sub)
    client_cmds.add_parsers(sub)
    users_cmds.add_parsers(sub)
    export_cmd.add_parser(sub)
    preprocess_cmd.add_parser(sub)
    return parser


def grid_report(grid, gpus_per_node: int) -> dict:
    """The ``raytron grid --json`` object: the sizes, every process group and each rank's
    coordinates, node and local slot (``--gpus-per-node`` per node)."""
    from service.spec.placement import plan_placement
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


def cmd_grid(args) -> int:
    from api.cli.tables import print_rank_grid
    from service.spec.limits import check_world_size
    from workers.grid import ParallelGrid

    try:
        check_world_size(args.world_size, "--world-size")
        grid = ParallelGrid(args.world_size, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                            etp=args.etp, vpp=args.vpp, order=args.order)
        report = grid_report(grid, args.gpus_per_node)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        json.dump(report, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
    else:
        print_rank_grid(report, grid.order)
    return 0


def cmd_run(args) -> int:
    from api.cli.run_cmd import cmd_run as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except UsageError as e:
        print(f"raytron {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a command installed its own handling
        print(f"raytron {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
