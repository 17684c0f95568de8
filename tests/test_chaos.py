"""The chaos drill (bench/chaos.py) in the suite, seeded and short: four faults of four kinds
(a rank killed, the job's runner killed, `raytron serve` killed and started again, a node lost
and another added) hit one job through `raytron serve --simulate 4x2`; every one must be
survived and the final curve equal the undisturbed one (1e-5). The drill's exit status says so.
32 iterations: the faults land at iterations 4, 11, 18 and 22 (seed 1), each at least 4 after the
one before, and the job has 10 left after the node is lost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
from tests.helpers.paths import ROOT


def test_four_faults_of_four_kinds_are_survived_on_the_undisturbed_curve():
    p = subprocess.run([sys.executable, "-m", "bench.chaos", "--seed", "1", "--faults", "4", "--iters", "32",
                        "--kinds", "rank_kill,runner_kill,server_kill,node_loss"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    assert "survived 4/4" in p.stdout and "chaos: PASSED" in p.stdout
    kinds = [line.split()[0] for line in p.stdout.splitlines() if line.startswith("  ") and "at iteration" in line]
    assert sorted(kinds) == ["node_loss", "rank_kill", "runner_kill", "server_kill"], p.stdout
