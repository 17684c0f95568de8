"""Run a benchmark module again as a child process (a fresh driver: its own imports, its own Ray
connection) and read the JSON object it prints last. Shared by the benchmarks that compare two
systems side by side (ray_startup_bench.py, recovery_bench.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(module: str, args: list[str], env: dict, timeout_s: float = 900) -> dict:
    """``python -m MODULE --child ARGS...`` in the repository root; its last stdout line that starts
    with ``{``, parsed. Exits with the child's stderr tail when it fails or prints none."""
    proc = subprocess.run([sys.executable, "-m", module, "--child", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"child {args[0]} failed with exit code {proc.returncode}")
    return json.loads(lines[-1])
