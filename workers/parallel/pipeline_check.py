"""Checkers of pipeline schedule tables (:mod:`workers.parallel.pipeline`,
:mod:`workers.parallel.pipeline_zb`): each stage's table is complete, and all stages' tables
together finish (no deadlock), with a makespan, and agree on each rank pair's message order.

:func:`simulate` times the tables with a duration per action kind (unit by default), so the
bubble of a schedule is its makespan less the work: 1F1B's ``(pp - 1)(F + B + W)`` against
ZB-H1's ``(pp - 1)(F + B - W)``, for instance, with ``B`` the input and ``W`` the weight gradient.

Nothing here imports torch.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from workers.parallel.pipeline import V_SHAPED, Action, in_flight_bound, place, schedule, virtual_stage


def splits(actions: Sequence[Action]) -> bool:
    """Whether the table splits its backwards into ``B`` and ``W`` (a zero-bubble table)."""
    return any(a.kind == "W" for a in actions)


def check_stage(actions: Sequence[Action], num_microbatches: int, vpp: int = 1) -> None:
    """Every (microbatch, chunk) is run forward once and backward once, backward after forward;
    in a table with ``W`` actions, also ``W`` once, after its ``B``.

    Raises:
        ValueError: naming the first offending action.
    """
    kinds = ("F", "B", "W") if splits(actions) else ("F", "B")
    done: dict[str, set[tuple[int, int]]] = {k: set() for k in kinds}
    for i, a in enumerate(actions):
        key = (a.microbatch, a.chunk)
        if a.kind not in kinds or not (0 <= a.microbatch < num_microbatches and 0 <= a.chunk < vpp):
            raise ValueError(f"step {i}: invalid action {a!r}")
        if key in done[a.kind]:
            raise ValueError(f"step {i}: {a!r} runs twice")
        before = {"F": None, "B": "F", "W": "B"}[a.kind]
        if before is not None and key not in done[before]:
            raise ValueError(f"step {i}: {a!r} runs before its {'forward' if before == 'F' else 'backward'}")
        done[a.kind].add(key)
    expected = num_microbatches * vpp
    if any(len(d) != expected for d in done.values()):
        counts = ", ".join(f"{len(d)} {k}" for k, d in done.items())
        raise ValueError(f"{counts}: expected {expected} each")


def max_in_flight(actions: Sequence[Action]) -> int:
    """Peak number of (microbatch, chunk) pairs forwarded but not yet done with: backwarded, or
    in a zero-bubble table weight-gradiented (the ``W`` still needs the layers' inputs)."""
    last = "W" if splits(actions) else "B"
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == last else 0
        peak = max(peak, live)
    return peak


def simulate(tables: Sequence[Sequence[Action]], vpp: int = 1, v_shape: bool = False,
             cost: Mapping[str, float] | None = None, durations: Sequence[Sequence[float]] | None = None) -> float:
    """Run all stages' tables, each in its order, as early as their inputs allow; return the makespan.

    F of virtual stage ``v`` needs F of ``v - 1`` (same microbatch), B of ``v`` needs B of
    ``v + 1`` and its own F, W its own B. ``cost`` gives each kind's duration (default 1:
    unit-time steps, where a table without W counts a whole backward as one); ``durations``
    instead gives each action its own (``durations[stage][i]``: e.g. measured). Sends never
    block, receives do: the dependency structure of the table alone (a buffering transport
    such as gloo). :func:`workers.parallel.pipeline_p2p.simulate_nccl` checks the executor's
    actual posting order under NCCL's stricter rules.

    Raises:
        ValueError: the tables deadlock (names each stuck stage's next action).
    """
    cost = {"F": 1, "B": 1, "W": 1, **(cost or {})}
    pp = len(tables)
    last = pp * vpp - 1
    finish: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> end time
    pos, free = [0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for s, table in enumerate(tables):
            while pos[s] < len(table):
                a = table[pos[s]]
                v = virtual_stage(s, a.chunk, pp, v_shape)
                needs = {"F": [("F", a.microbatch, v - 1)] if v > 0 else [],
                         "B": [("F", a.microbatch, v)] + ([("B", a.microbatch, v + 1)] if v < last else []),
                         "W": [("B", a.microbatch, v)]}[a.kind]
                if any(n not in finish for n in needs):
                    break
                start = max([free[s]] + [finish[n] for n in needs])
                took = cost[a.kind] if durations is None else durations[s][pos[s]]
                free[s] = finish[(a.kind, a.microbatch, v)] = start + took
                pos[s] += 1
                progress = True
    if any(pos[s] < len(t) for s, t in enumerate(tables)):
        stuck = {s: tables[s][pos[s]] for s in range(pp) if pos[s] < len(tables[s])}
        raise ValueError(f"deadlock: stages wait on {stuck}")
    return max(free)


def messages(tables: Sequence[Sequence[Action]], vpp: int = 1, v_shape: bool = False):
    """``(sent, received)``: per (sender stage, receiver stage), the messages in table order,
    each ``(direction, microbatch, sending virtual stage)``; a hand-over between two chunks of
    one stage (the V's turn) is no message."""
    pp = len(tables)
    last = pp * vpp - 1
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for s, table in enumerate(tables):
        for a in table:
            v = virtual_stage(s, a.chunk, pp, v_shape)
            if a.kind == "W":
                continue
            step = 1 if a.kind == "F" else -1
            src, dst = v - step, v + step  # the input's sender, the output's receiver
            if 0 <= src <= last and place(src, pp, v_shape)[0] != s:
                received.setdefault((place(src, pp, v_shape)[0], s), []).append((a.kind, a.microbatch, src))
            if 0 <= dst <= last and place(dst, pp, v_shape)[0] != s:
                sent.setdefault((s, place(dst, pp, v_shape)[0]), []).append((a.kind, a.microbatch, v))
    return sent, received


def check_message_order(tables: Sequence[Sequence[Action]], vpp: int = 1, v_shape: bool = False) -> None:
    """Each rank pair's messages are received in the order they are sent.

    No backend here uses tags, so a pair's messages are matched by posting order; Megatron's
    tables satisfy this. The V tables do not (a stage pair carries activations one way and
    gradients the other, each side in its own order): for them each message sent must be
    received once, and :func:`workers.parallel.pipeline_p2p.p2p_plan` posts the receives in
    the sender's order.

    Raises:
        ValueError: naming the first pair (sender, receiver) whose orders differ.
    """
    sent, received = messages(tables, vpp, v_shape)
    same = (lambda a, b: sorted(a or []) == sorted(b or [])) if v_shape else (lambda a, b: a == b)
    for pair in sorted(set(sent) | set(received)):
        if not same(sent.get(pair), received.get(pair)):
            raise ValueError(f"stage {pair[0]} -> {pair[1]}: sends {sent.get(pair)} but receives {received.get(pair)}")


def check_schedule(num_microbatches: int, pp: int, vpp: int | None = None, name: str | None = None,
                   cost: Mapping[str, float] | None = None) -> float:
    """Build every stage's table and check it fully; return the simulated makespan.

    Raises:
        ValueError: a table misses or repeats work, deadlocks, exceeds its memory bound, or
            receives a pair's messages in another order than they were sent.
    """
    chunks = 1 if vpp is None else vpp
    v_shape = name in V_SHAPED
    tables = [schedule(num_microbatches, pp, vpp, s, name) for s in range(pp)]
    for s, table in enumerate(tables):
        check_stage(table, num_microbatches, chunks)
        peak, bound = max_in_flight(table), in_flight_bound(num_microbatches, pp, vpp, s, name)
        if peak > bound:
            raise ValueError(f"stage {s} holds {peak} activations at once, bound {bound}")
    check_message_order(tables, chunks, v_shape)
    return simulate(tables, chunks, v_shape, cost)
