"""The rank grid: an order string and parallel sizes -> coordinates and rank groups.

Pure integer math, no torch. It reproduces Megatron-Core's ``RankGenerator`` exactly
(``megatron/core/parallel_state.py``):

* The order string lists the axes from fastest- to slowest-varying: with
  ``tp-cp-ep-dp-pp``, ranks 0 and 1 differ in tp, ranks 0 and tp differ in cp, and so on.
  ``rank = sum(coord[axis] * stride[axis])`` with ``stride`` the prefix product of the
  sizes in order.
* A group kind (``"tp"``, ``"dp-cp"``, ...) is the set of axes that vary inside a group;
  the other axes are fixed per group. Groups are listed with the fixed axes enumerated
  fastest-first, and ranks inside a group with the varying axes enumerated fastest-first
  *in the order string's order* (so a pp group lists its stages in order).
* Two views share the world: the decoder view (tp, cp, dp, pp; ep = 1) and the expert
  view (etp as its tp, ep, expert-dp as its dp, the same pp; cp = 1). Their pp groups
  must agree.

Example (the seed's worked example): world 16, tp 2, cp 2, pp 2, order tp-cp-dp-pp gives
dp 2 and TP groups [0,1],[2,3],...; CP [0,2],[1,3],...; DP [0,4],[1,5],...; PP [0,8],[1,9],...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from math import prod

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# A rank's coordinates as the job reports them (placement records, metric tags, failures,
# a checkpoint's layout), in this order.
COORDS = ("tp", "pp", "dp", "cp", "ep")

DECODER_KINDS = ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-cp", "tp-dp", "tp-dp-cp")
EXPERT_KINDS = ("tp", "ep", "tp-ep", "tp-ep-pp", "dp", "pp")

# Megatron's argument names, used in error messages so a user can find the flag to change.
FIELD = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
}


def parse_order(order: str) -> tuple[str, ...]:
    """Split and check an order string (case-insensitive); every axis at most once."""
    if not isinstance(order, str) or not order.strip():
        raise ValueError(f"order must be a string such as {DEFAULT_ORDER!r}, got {order!r}")
    tokens = tuple(t.strip() for t in order.lower().split("-"))
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise ValueError(
            f"order {order!r}: unknown token(s) {unknown}; use only {', '.join(AXES)} "
            f"joined by '-', e.g. {DEFAULT_ORDER!r}"
        )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ValueError(f"order {order!r}: token(s) {repeated} repeated; name each axis once, e.g. {DEFAULT_ORDER!r}")
    return tokens


def _prefix_product(sizes):
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    return out


def _decompose(index: int, shape) -> list[int]:
    strides = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, strides)]


def masked_rank_groups(world_size: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron's ``generate_masked_orthogonal_rank_groups``.

    ``sizes`` are the axis sizes in order (fastest first); ``mask`` selects the axes that
    vary inside a group. Returns the groups, each a list of global ranks.
    """
    masked_shape = [s for s, m in zip(sizes, mask) if m]
    unmasked_shape = [s for s, m in zip(sizes, mask) if not m]
    stride = _prefix_product(sizes)
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    group_size = prod(masked_shape)
    num_groups = world_size // group_size
    # Offsets of members inside a group are the same for every group: compute them once.
    member_offsets = [
        sum(i * d for i, d in zip(_decompose(k, masked_shape), masked_stride)) for k in range(group_size)
    ]
    groups = []
    for g in range(num_groups):
        base = sum(i * d for i, d in zip(_decompose(g, unmasked_shape), unmasked_stride))
        groups.append([base + off for off in member_offsets])
    return groups


@dataclass(frozen=True)
class _View:
    """One of Megatron's two rank generators (decoder or expert)."""

    world_size: int
    order: tuple[str, ...]
    sizes: dict

    @cached_property
    def _full_order(self) -> tuple[str, ...]:
        # Megatron appends axes of size 1 that the order leaves out.
        return self.order + tuple(a for a in AXES if a not in self.order)

    @cached_property
    def _ordered_sizes(self) -> list[int]:
        return [self.sizes[a] for a in self._full_order]

    def groups(self, kind: str) -> list[list[int]]:
        tokens = kind.split("-")
        mask = [a in tokens for a in self._full_order]
        return masked_rank_groups(self.world_size, self._ordered_sizes, mask)

    def coords(self, rank: int) -> dict[str, int]:
        return dict(zip(self._full_order, _decompose(rank, self._ordered_sizes)))


@dataclass(frozen=True)
class ParallelGrid:
    """An immutable rank grid for one job.

    Args:
        world_size: number of ranks.
        tp, pp, cp, ep: tensor, pipeline, context and expert parallel sizes.
        etp: expert tensor parallel size; ``None`` means equal to ``tp``.
        vpp: virtual pipeline (interleaved) chunks per stage; ``None`` for none.
        order: axes from fastest- to slowest-varying, e.g. ``"tp-cp-ep-dp-pp"``.

    Raises:
        ValueError: with the fields, the numbers and a fix, for any invalid combination.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    order: str = DEFAULT_ORDER
    tokens: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "tokens", parse_order(self.order))
        object.__setattr__(self, "order", "-".join(self.tokens))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        self._validate()

    @classmethod
    def from_config(cls, parallel, world_size: int) -> "ParallelGrid":
        """The grid of a :class:`workers.config.ParallelConfig` on ``world_size`` ranks."""
        p = parallel
        return cls(world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                   cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                   etp=p.expert_tensor_parallel_size, vpp=p.virtual_pipeline_model_parallel_size,
                   order=p.order)

    # ----------------------------------------------------------------- validation
    def _validate(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                field_name = FIELD.get(name, name)
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or isinstance(self.vpp, bool) or self.vpp < 1:
                raise ValueError(f"{FIELD['vpp']} must be a positive integer or null, got {self.vpp!r}")
            if self.pp == 1:
                raise ValueError(
                    f"{FIELD['vpp']}={self.vpp} needs {FIELD['pp']} > 1 (interleaving splits each "
                    f"pipeline stage into chunks); set {FIELD['pp']} >= 2 or {FIELD['vpp']} to null"
                )
        model = self.tp * self.pp * self.cp
        if self.world_size % model:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by the model-parallel size "
                f"tp({self.tp}) x pp({self.pp}) x cp({self.cp}) = {model}; "
                f"{_divisibility_fix(self.world_size, model)}"
            )
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise ValueError(
                f"world_size {self.world_size} is not divisible by the expert model-parallel size "
                f"etp({self.etp}) x ep({self.ep}) x pp({self.pp}) = {expert}; "
                f"{_divisibility_fix(self.world_size, expert)}"
            )
        # Megatron's RankGenerator: an axis of size > 1 in either view must be named.
        for view in (self._decoder, self._expert):
            for axis, size in view.sizes.items():
                if size > 1 and axis not in self.tokens:
                    label = "etp" if view is self._expert and axis == "tp" else axis
                    label = "expert_dp" if view is self._expert and axis == "dp" else label
                    raise ValueError(
                        f"order {self.order!r} does not name {axis!r}, but {label} is {size}; "
                        f"add it, e.g. {DEFAULT_ORDER!r}"
                    )
        if self.pp > 1 and self.tokens[-1] != "pp" and self.expert_dp != self.dp:
            raise ValueError(
                f"order {self.order!r} does not end with 'pp', which Megatron allows only when the "
                f"expert data-parallel size equals the data-parallel size (here {self.expert_dp} vs "
                f"{self.dp}); put pp last or choose ep x etp = cp x tp"
            )
        if self._decoder.groups("pp") != self._expert.groups("pp"):
            raise ValueError(
                f"pipeline groups of the dense and expert layers differ for order {self.order!r} "
                f"(tp {self.tp}, cp {self.cp}, dp {self.dp} vs etp {self.etp}, ep {self.ep}, "
                f"expert dp {self.expert_dp}); put pp last in the order"
            )

    # ----------------------------------------------------------------- sizes
    @property
    def dp(self) -> int:
        """Data-parallel size of the dense layers: world / (tp x pp x cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the expert layers: world / (etp x ep x pp)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def sizes(self) -> dict[str, int]:
        return {
            "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
            "etp": self.etp, "dp": self.dp, "expert_dp": self.expert_dp,
        }

    # ----------------------------------------------------------------- views
    @cached_property
    def _decoder(self) -> _View:
        return _View(self.world_size, self.tokens,
                     {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp})

    @cached_property
    def _expert(self) -> _View:
        return _View(self.world_size, self.tokens,
                     {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp})

    def groups(self, kind: str, *, expert: bool = False) -> list[list[int]]:
        """All groups of one kind, e.g. ``groups("dp-cp")`` or ``groups("ep", expert=True)``."""
        kinds = EXPERT_KINDS if expert else DECODER_KINDS
        if kind not in kinds:
            raise ValueError(f"unknown {'expert' if expert else 'decoder'} group kind {kind!r}; one of {kinds}")
        return (self._expert if expert else self._decoder).groups(kind)

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pp group (they hold the tied embeddings)."""
        return [[g[0], g[-1]] if len(g) > 1 else list(g) for g in self.groups("pp")]

    def position_embedding_groups(self) -> list[list[int]]:
        return [[g[0]] for g in self.groups("pp")]

    def coords(self, rank: int) -> dict[str, int]:
        """Every coordinate of one rank: tp, cp, dp, pp, ep, etp, expert_dp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        d = self._decoder.coords(rank)
        e = self._expert.coords(rank)
        return {"tp": d["tp"], "cp": d["cp"], "dp": d["dp"], "pp": d["pp"],
                "ep": e["ep"], "etp": e["tp"], "expert_dp": e["dp"]}

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Inverse of :meth:`coords` for the decoder view."""
        c = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": 0}
        stride = _prefix_product(self._decoder._ordered_sizes)
        return sum(c[a] * s for a, s in zip(self._decoder._full_order, stride))

    def group_of(self, rank: int, kind: str, *, expert: bool = False) -> list[int]:
        """The group of ``kind`` that contains ``rank`` (computed, not searched)."""
        view = self._expert if expert else self._decoder
        tokens = kind.split("-")
        c = view.coords(rank)
        order = view._full_order
        stride = dict(zip(order, _prefix_product(view._ordered_sizes)))
        base = sum(c[a] * stride[a] for a in order if a not in tokens)
        varying = [a for a in order if a in tokens]
        shape = [view.sizes[a] for a in varying]
        return [base + sum(i * stride[a] for i, a in zip(_decompose(k, shape), varying)) for k in range(prod(shape))]


def _divisibility_fix(world_size: int, size: int) -> str:
    """Suggest world sizes that would divide, and sizes that would divide the world."""
    lower = world_size - world_size % size
    options = [n for n in (lower, lower + size) if n > 0]
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0 and d <= size * 2]
    return (
        f"use a world_size that is a multiple of {size} (e.g. {' or '.join(map(str, options))}), "
        f"or parallel sizes whose product divides {world_size} (its divisors: {divisors})"
    )
