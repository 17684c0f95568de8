"""Write a docs page that is generated from the code, or check that it is current (``--check``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


def write_or_check(argv, page: Path, render: Callable[[], str], module: str, description: str) -> int:
    """``python -m MODULE``: write ``render()`` to ``page``; with ``--check``: exit 1 when it differs."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not page.exists() or page.read_text() != text:
            print(f"{page.relative_to(ROOT)} is stale: run python -m {module}", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    print(f"wrote {page.relative_to(ROOT)}")
    return 0
