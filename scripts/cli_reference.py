"""Write docs/cli-reference.md, every ``raytron`` command and flag with its help, from the CLI's own parser.

    python -m scripts.cli_reference          # rewrite docs/cli-reference.md
    python -m scripts.cli_reference --check  # exit 1 when the file is not what the parser gives

tests/test_docs.py runs ``--check``, so the page always says what ``raytron COMMAND --help`` says.
"""

from __future__ import annotations

import argparse
import sys

from scripts.generated_page import ROOT, write_or_check

PAGE = ROOT / "docs" / "cli-reference.md"

HEADER = """# CLI reference

Generated from the parser by `python -m scripts.cli_reference`; do not edit by hand. The guide
with examples is [cli.md](cli.md). Every command exits 2 with one line naming the problem on
invalid input.
"""


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``raytron``'s sub-commands by name, aliases left out."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen, out = set(), {}
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    out[name] = sub
            return out
    return {}


def _cell(text: str) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _command(name: str, sub: argparse.ArgumentParser) -> list[str]:
    usage = " ".join(sub.format_usage().split())
    usage = usage[len("usage: "):] if usage.startswith("usage: ") else usage
    lines = [f"## `raytron {name}`", "", _cell(sub.description), "", "```", usage, "```", ""]
    rows = []
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        if isinstance(action, argparse._SubParsersAction):
            rows += [f"| `{n}` | {_cell(s.description or '')} |" for n, s in subcommands(sub).items()]
            continue
        rows.append(f"| {names} | {_cell(action.help)} |")
    if rows:
        lines += ["| argument | meaning |", "|---|---|", *rows, ""]
    for inner_name, inner in subcommands(sub).items():
        lines += _command(f"{name} {inner_name}", inner)
    return lines


def render() -> str:
    from api.cli.main import build_parser

    lines = [HEADER]
    for name, sub in subcommands(build_parser()).items():
        lines += _command(name, sub)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    return write_or_check(argv, PAGE, render, "scripts.cli_reference", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
