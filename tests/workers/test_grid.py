"""Rank grid: golden tables, a brute-force oracle of Megatron's semantics, and validation."""

import itertools
import random

import pytest

from workers.grid import AXES, DECODER_KINDS, EXPERT_KINDS, ParallelGrid, parse_order


# ------------------------------------------------------------------ golden tables
def test_seed_worked_example_world16():
    g = ParallelGrid(16, tp=2, cp=2, pp=2, order="tp-cp-dp-pp")
    assert g.dp == 2
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.groups("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g.groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.groups("tp-pp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    # The default order names ep too (size 1) and gives the same decoder groups.
    assert ParallelGrid(16, tp=2, cp=2, pp=2).groups("dp") == g.groups("dp")


def test_megatron_docstring_24_ranks_tp2_dp3_pp4():
    g = ParallelGrid(24, tp=2, pp=4, order="tp-dp-pp")
    assert g.dp == 3
    assert g.groups("tp") == [[2 * i, 2 * i + 1] for i in range(12)]
    assert g.groups("dp") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11],
                              [12, 14, 16], [13, 15, 17], [18, 20, 22], [19, 21, 23]]
    assert g.groups("pp") == [[0, 6, 12, 18], [1, 7, 13, 19], [2, 8, 14, 20],
                              [3, 9, 15, 21], [4, 10, 16, 22], [5, 11, 17, 23]]
    assert g.embedding_groups()[0] == [0, 18]
    assert g.position_embedding_groups()[0] == [0]


def test_megatron_docstring_16_ranks_tp2_pp4():
    g = ParallelGrid(16, tp=2, pp=4)
    assert g.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert g.groups("dp")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_expert_view_default_order():
    g = ParallelGrid(8, tp=2, ep=2, etp=1)
    assert g.sizes() == {"tp": 2, "pp": 1, "cp": 1, "ep": 2, "etp": 1, "dp": 4, "expert_dp": 4}
    assert g.groups("ep", expert=True) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("dp", expert=True) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.groups("tp", expert=True) == [[r] for r in range(8)]


# ------------------------------------------------------------------ brute-force oracle
def oracle_groups(world, sizes, order, kind):
    """Megatron's semantics by definition: coordinates by mixed radix (first token fastest);
    a group = the ranks sharing every coordinate outside ``kind``; groups enumerated by the
    fixed coordinates fastest-first, members by the varying ones in the order's order."""
    tokens = list(order) + [a for a in AXES if a not in order]
    radix = [sizes[a] for a in tokens]
    coords = {}
    for r in range(world):
        c, x = {}, r
        for a, s in zip(tokens, radix):
            c[a] = x % s
            x //= s
        coords[r] = c
    varying = [a for a in tokens if a in kind.split("-")]
    fixed = [a for a in tokens if a not in varying]
    key_fixed = lambda r: tuple(coords[r][a] for a in reversed(fixed))
    key_vary = lambda r: tuple(coords[r][a] for a in reversed(varying))
    buckets = {}
    for r in range(world):
        buckets.setdefault(key_fixed(r), []).append(r)
    return [sorted(m, key=key_vary) for _, m in sorted(buckets.items())]


def _valid_layouts(count, seed=0, max_world=64):
    rng = random.Random(seed)
    orders = ["-".join(p) for p in itertools.permutations(AXES)]
    out = []
    while len(out) < count:
        tp, pp, cp, ep, etp = (rng.choice([1, 2, 4]) for _ in range(5))
        dp = rng.choice([1, 2, 3, 4])
        world = tp * pp * cp * dp
        if world > max_world:
            continue
        vpp = rng.choice([None, 2]) if pp > 1 else None
        try:
            out.append(ParallelGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, order=rng.choice(orders)))
        except ValueError:
            continue
    return out


@pytest.mark.parametrize("grid", _valid_layouts(60), ids=lambda g: f"{g.world_size}-{g.order}-{g.sizes()}")
def test_groups_match_megatron_semantics(grid):
    dec = {"tp": grid.tp, "cp": grid.cp, "ep": 1, "dp": grid.dp, "pp": grid.pp}
    exp = {"tp": grid.etp, "cp": 1, "ep": grid.ep, "dp": grid.expert_dp, "pp": grid.pp}
    for kind in DECODER_KINDS:
        assert grid.groups(kind) == oracle_groups(grid.world_size, dec, grid.tokens, kind), kind
    for kind in EXPERT_KINDS:
        assert grid.groups(kind, expert=True) == oracle_groups(grid.world_size, exp, grid.tokens, kind), kind


@pytest.mark.parametrize("grid", _valid_layouts(40, seed=1), ids=lambda g: f"{g.world_size}-{g.order}")
def test_properties(grid):
    w = grid.world_size
    expected_size = {"tp": grid.tp, "pp": grid.pp, "dp": grid.dp, "cp": grid.cp, "dp-cp": grid.dp * grid.cp,
                     "tp-pp": grid.tp * grid.pp, "tp-cp": grid.tp * grid.cp, "tp-dp": grid.tp * grid.dp,
                     "tp-dp-cp": grid.tp * grid.dp * grid.cp}
    expert_size = {"tp": grid.etp, "ep": grid.ep, "tp-ep": grid.etp * grid.ep, "tp-ep-pp": grid.etp * grid.ep * grid.pp,
                   "dp": grid.expert_dp, "pp": grid.pp}
    for expert, sizes in ((False, expected_size), (True, expert_size)):
        for kind, size in sizes.items():
            groups = grid.groups(kind, expert=expert)
            assert sorted(r for g in groups for r in g) == list(range(w)), "partitions the world"
            assert all(len(g) == size for g in groups)
            for g in groups:
                for r in g:
                    assert grid.group_of(r, kind, expert=expert) == g
    assert grid.groups("pp") == grid.groups("pp", expert=True)
    for r in range(w):
        c = grid.coords(r)
        assert grid.rank_of(tp=c["tp"], cp=c["cp"], dp=c["dp"], pp=c["pp"]) == r
        assert grid.groups("tp")[0].__len__() == grid.tp
        # A rank's place in its group is its coordinate on that axis.
        assert grid.group_of(r, "tp").index(r) == c["tp"]
        assert grid.group_of(r, "pp").index(r) == c["pp"]
        assert grid.group_of(r, "ep", expert=True).index(r) == c["ep"]


def test_pp_groups_list_stages_in_order():
    g = ParallelGrid(16, tp=2, pp=4, order="pp-tp-dp")
    for group in g.groups("pp"):
        assert [g.coords(r)["pp"] for r in group] == [0, 1, 2, 3]


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(world_size=10, tp=4), ["world_size 10", "tp(4)", "= 4", "multiple of 4"]),
        (dict(world_size=12, tp=2, pp=2, cp=2), ["world_size 12", "= 8"]),
        (dict(world_size=8, ep=3), ["expert", "ep(3)", "world_size 8"]),
        (dict(world_size=8, vpp=2), ["virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size > 1"]),
        (dict(world_size=8, tp=0), ["tensor_model_parallel_size", "positive"]),
        (dict(world_size=8, order="tp-cp-xx-dp-pp"), ["unknown", "xx"]),
        (dict(world_size=8, order="tp-dp-tp-pp"), ["repeated", "tp"]),
        (dict(world_size=8, tp=2, order="dp-pp"), ["does not name 'tp'"]),
        (dict(world_size=8, ep=2, order="tp-dp-pp"), ["does not name 'ep'"]),
        (dict(world_size=8, pp=2, ep=2, etp=1, tp=2, order="tp-pp-ep-dp"), ["pp"]),
        (dict(world_size=0), ["world_size", "positive"]),
    ],
)
def test_validation_errors_name_fields_numbers_and_fix(kwargs, needles):
    with pytest.raises(ValueError) as e:
        ParallelGrid(**kwargs)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_order_is_case_insensitive_and_normalised():
    assert parse_order("TP-Cp-EP-dp-PP") == ("tp", "cp", "ep", "dp", "pp")
    assert ParallelGrid(8, tp=2, order="TP-DP-PP").order == "tp-dp-pp"


def test_non_pp_last_order_allowed_when_expert_dp_equals_dp():
    g = ParallelGrid(8, tp=2, pp=2, order="tp-pp-dp")
    assert g.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
