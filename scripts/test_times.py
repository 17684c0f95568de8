"""How long the suite's tiers and its slowest tests took in the last run.

    python -m scripts.test_times            # tiers, then the 25 slowest tests
    python -m scripts.test_times --top 60   # more of them
    python -m scripts.test_times --tier ray # only one tier's tests

Every pytest run writes ``.pytest_times.json`` at the repository root (tests/conftest.py): each
test's tier (its marker: gpu, slow, ray, procs, or fast for none) and its seconds, setup and
teardown included, so a module-scoped fixture's cost shows on the test that paid it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMES = ROOT / ".pytest_times.json"
TIERS = ("fast", "procs", "slow", "ray", "gpu")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the time per tier and the slowest tests of the last pytest run.")
    parser.add_argument("--top", type=int, default=25, help="how many of the slowest tests to list (default 25)")
    parser.add_argument("--tier", choices=TIERS, help="list only this tier's tests")
    parser.add_argument("--file", type=Path, default=TIMES, help=f"the times file (default {TIMES.name})")
    args = parser.parse_args(argv)
    if not args.file.exists():
        print(f"{args.file} does not exist: run the tests first (make test, or pytest)", file=sys.stderr)
        return 2
    run = json.loads(args.file.read_text())
    tests = run["tests"]
    total = defaultdict(float)
    count = defaultdict(int)
    for t in tests.values():
        total[t["tier"]] += t["seconds"]
        count[t["tier"]] += 1
    print(f"run of {run['finished']}: {len(tests)} tests, {run['wall_s']:.0f} s wall")
    print(f"{'tier':<6} {'tests':>6} {'seconds':>9} {'minutes':>8}")
    for tier in TIERS:
        if count[tier]:
            print(f"{tier:<6} {count[tier]:>6} {total[tier]:>9.1f} {total[tier] / 60:>8.1f}")
    chosen = [(t["seconds"], t["tier"], nodeid) for nodeid, t in tests.items() if args.tier in (None, t["tier"])]
    print(f"\nslowest {min(args.top, len(chosen))}:")
    for seconds, tier, nodeid in sorted(chosen, reverse=True)[:args.top]:
        print(f"{seconds:8.1f} s  {tier:<5} {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
