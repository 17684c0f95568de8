"""Every process group gets the job's collective timeout (torch's default is 30 minutes, which
let a hung rank inside a TP or PP group go unnoticed)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.procs


def _group_timeouts(rank, world_size, explicit):
    import torch

    from workers.grid import ParallelGrid
    from workers.parallel.groups import build_process_groups, world_timeout

    grid = ParallelGrid(world_size, tp=2, pp=2)
    groups = build_process_groups(grid, rank, timeout=timedelta(seconds=explicit) if explicit else None)
    seconds = {name: h._get_backend(torch.device("cpu")).options._timeout.total_seconds()
               for name, h in groups.handles().items() if h is not None}
    return world_timeout().total_seconds(), seconds


def test_groups_inherit_the_world_timeout():
    for world, groups in run_ranks(_group_timeouts, 4, args=(None,), collective_timeout_s=7):
        assert world == 7.0
        assert {"tp", "pp", "tp_pp", "embedding"} <= set(groups) and set(groups.values()) == {7.0}, groups


def test_an_explicit_timeout_wins():
    for _, groups in run_ranks(_group_timeouts, 4, args=(11,), collective_timeout_s=7):
        assert set(groups.values()) == {11.0}
