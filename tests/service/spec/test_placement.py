"""Placement plans: TP groups never split, CP/EP kept in a node when they fit."""

import itertools

import pytest

from service.spec.placement import check_tp_in_node, plan_placement
from workers.grid import AXES, ParallelGrid

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]


def _layouts():
    for order in ORDERS:
        for tp, cp, pp, ep, dp in [(2, 1, 2, 1, 2), (2, 2, 1, 1, 2), (4, 1, 1, 2, 2), (2, 1, 1, 2, 4), (1, 2, 2, 1, 2)]:
            try:
                yield ParallelGrid(tp * cp * pp * dp, tp=tp, cp=cp, pp=pp, ep=ep, order=order)
            except ValueError:
                pass


def _tp_block(grid):
    """Largest set of ranks connected through dense or expert TP groups (by BFS)."""
    groups = grid.groups("tp") + grid.groups("tp", expert=True)
    best, seen = 0, set()
    for start in range(grid.world_size):
        if start in seen:
            continue
        comp, todo = {start}, [start]
        while todo:
            r = todo.pop()
            for g in groups:
                if r in g:
                    for q in g:
                        if q not in comp:
                            comp.add(q)
                            todo.append(q)
        seen |= comp
        best = max(best, len(comp))
    return best


@pytest.mark.parametrize("gpus_per_node", [2, 4, 8])
def test_tp_groups_never_split_for_any_order(gpus_per_node):
    checked = 0
    for grid in _layouts():
        if grid.tp > gpus_per_node or grid.etp > gpus_per_node:
            continue
        if _tp_block(grid) > gpus_per_node:
            # Dense and expert TP groups interlock (ep before tp in the order): no plan can
            # keep both inside a node, and the planner must say so.
            with pytest.raises(ValueError, match="interlock"):
                plan_placement(grid, gpus_per_node)
            continue
        plan = plan_placement(grid, gpus_per_node)
        assert [p.rank for p in plan] == list(range(grid.world_size))
        slots = {(p.node, p.local) for p in plan}
        assert len(slots) == grid.world_size, "no slot used twice"
        assert all(0 <= p.local < gpus_per_node for p in plan)
        node_of = {p.rank: p.node for p in plan}
        assert check_tp_in_node(grid, node_of) == []
        for node in {p.node for p in plan}:
            locals_ = sorted(p.local for p in plan if p.node == node)
            assert locals_ == list(range(len(locals_))), "consecutive local slots"
            ranks = sorted(p.rank for p in plan if p.node == node)
            assert [p.local for p in sorted(plan, key=lambda q: q.rank) if p.node == node] == list(range(len(ranks)))
        checked += 1
    assert checked > 50


def test_default_order_is_rank_div_gpus():
    grid = ParallelGrid(16, tp=2, pp=2, cp=2)
    plan = plan_placement(grid, 4)
    assert [(p.node, p.local) for p in plan] == [(r // 4, r % 4) for r in range(16)]


def test_tp_not_innermost_still_in_node():
    grid = ParallelGrid(8, tp=2, pp=2, order="dp-tp-pp")
    plan = plan_placement(grid, 2)
    node_of = {p.rank: p.node for p in plan}
    assert grid.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert check_tp_in_node(grid, node_of) == []
    assert node_of[0] == node_of[2] and node_of[1] == node_of[3]


def test_cp_kept_in_node_when_it_fits():
    grid = ParallelGrid(16, tp=2, cp=2, order="tp-dp-cp-pp")  # cp outermost: far apart ranks
    plan = plan_placement(grid, 4)
    node_of = {p.rank: p.node for p in plan}
    for g in grid.groups("cp"):
        assert len({node_of[r] for r in g}) == 1
    assert check_tp_in_node(grid, node_of) == []


def test_ep_kept_in_node_when_it_fits():
    grid = ParallelGrid(8, tp=1, ep=2, order="tp-cp-dp-ep-pp")
    node_of = {p.rank: p.node for p in plan_placement(grid, 2)}
    for g in grid.groups("ep", expert=True):
        assert len({node_of[r] for r in g}) == 1


def test_tp_larger_than_node_is_refused():
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size 8 is larger than gpus_per_node 4"):
        plan_placement(ParallelGrid(16, tp=8), 4)


def test_world_too_big_for_nodes():
    with pytest.raises(ValueError, match=r"world_size 16 does not fit 2 node\(s\) x 4 GPUs = 8 slots"):
        plan_placement(ParallelGrid(16, tp=2), 4, num_nodes=2)


def test_interlocking_tp_and_etp_blocks():
    # tp groups [0,1],...; etp=4 groups of [0..3] -> atoms of 4 ranks: fit a 4-slot node.
    grid = ParallelGrid(8, tp=2, etp=4, ep=1)
    node_of = {p.rank: p.node for p in plan_placement(grid, 4)}
    assert check_tp_in_node(grid, node_of) == []
    with pytest.raises(ValueError, match="expert_tensor_parallel_size 4 is larger than gpus_per_node 2"):
        plan_placement(grid, 2)
