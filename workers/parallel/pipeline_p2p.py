"""The point-to-point posting order of a pipeline stage, and a simulator with NCCL's semantics.

:func:`p2p_plan` turns a stage's schedule table (:mod:`workers.parallel.pipeline`) into the
exact sequence of communication batches the executor (:mod:`workers.parallel.pipeline_exec`)
posts: before each action, one batch holding the send of the previous action's output and
the receive of this action's input, posted together in one ``batch_isend_irecv`` (Megatron's
``send_forward_recv_backward``, ``send_backward_recv_forward`` and friends). A batch is
waited for as a whole before the action computes.

NCCL differs from gloo in three ways that matter here, and :func:`simulate_nccl` models all
three, so a plan it accepts cannot deadlock or mix up messages on NCCL:

* a send does not complete until the peer has posted the matching receive (large messages
  do not fit NCCL's internal buffers);
* the operations of one (sender, receiver) pair match in posting order: tags are ignored;
* a rank's operations run in stream order: a batch starts after the previous one finished.

Posting each send and each receive on its own (what this executor did before) deadlocks in
that model for 1F1B steady state: stage s sits in ``send F(k+w)`` while stage s+1 sits in
``send B(k)``, each waiting for a receive queued behind the other's send.

The zero-bubble tables (:mod:`workers.parallel.pipeline_zb`) post the same way, one action a
step (a ``W`` has no message). ZBV's stage pair carries activations one way and gradients the
other way in an order the receiving table does not follow, so given every stage's table
:func:`p2p_plan` posts each receive from a peer no later than that peer's send order asks
(early receives wait in a buffer); for 1F1B and interleaved that order is the table's own.

Nothing here imports torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

from workers.parallel.pipeline import (V_SHAPED, Action, interleaved_warmup, place, schedule, schedule_forward_only,
                                      virtual_stage)


@dataclass(frozen=True)
class P2POp:
    """One point-to-point operation of a stage.

    Attributes:
        kind: ``"send"`` or ``"recv"``.
        peer: the other pipeline stage (0-based stage index, not a global rank).
        message: what travels, ``(direction, microbatch, sending virtual stage)`` with direction
            ``"F"`` (activation, to virtual stage + 1) or ``"B"`` (its gradient, to - 1).
    """

    kind: str
    peer: int
    message: tuple[str, int, int]


@dataclass(frozen=True)
class Step:
    """One batch of operations posted together, then (optionally) one action computed.

    Attributes:
        ops: posted in one ``batch_isend_irecv`` and all waited for before ``actions``.
        actions: the compute that follows (one action, or a forward and a backward in the
            interleaved steady state); empty for the final batch (the last sends).
    """

    ops: tuple[P2POp, ...]
    actions: tuple[Action, ...]


def _peer(a: Action, stage: int, pp: int, vpp: int, v_shape: bool, output: bool) -> tuple[int, int, int] | None:
    """(peer stage, this virtual stage, peer virtual stage) of an action's input or output
    message; None without one (first / last virtual stage, a ``W``, the V's local turn)."""
    if a.kind == "W":
        return None
    v = virtual_stage(stage, a.chunk, pp, v_shape)
    other = v + (1 if (a.kind == "F") == output else -1)
    if not 0 <= other < pp * vpp:
        return None
    peer = place(other, pp, v_shape)[0]
    return None if peer == stage else (peer, v, other)


def _input_of(a: Action, stage: int, pp: int, vpp: int, v_shape: bool = False) -> P2POp | None:
    """The receive an action needs first (None on the first / last virtual stage)."""
    found = _peer(a, stage, pp, vpp, v_shape, output=False)
    return None if found is None else P2POp("recv", found[0], (a.kind, a.microbatch, found[2]))


def _output_of(a: Action, stage: int, pp: int, vpp: int, v_shape: bool = False) -> P2POp | None:
    """The send an action's result needs (None on the last / first virtual stage)."""
    found = _peer(a, stage, pp, vpp, v_shape, output=True)
    return None if found is None else P2POp("send", found[0], (a.kind, a.microbatch, found[1]))


def _compute_steps(actions: Sequence[Action], stage: int, pp: int, vpp: int) -> list[tuple[Action, ...]]:
    """Group the table into compute steps with no communication inside a step.

    1F1B (``vpp == 1``): one action per step. Interleaved: each steady-state (forward,
    backward) pair is one step, as in Megatron's interleaved schedule, which runs both and
    then exchanges all four tensors in one batch (posting the forward's send before the
    backward's receive deadlocks under NCCL for every vpp > 1); warm-up forwards and
    cool-down backwards stay single.
    """
    if vpp == 1 or any(a.kind == "W" for a in actions) or all(a.kind == "F" for a in actions):
        return [(a,) for a in actions]  # 1F1B, zero-bubble, or forward-only (evaluation)
    total = len(actions) // 2
    warmup = interleaved_warmup(total // vpp, pp, vpp, stage)
    steady = range(warmup, warmup + 2 * (total - warmup), 2)
    steps = [(a,) for a in actions[:warmup]]
    steps += [(actions[i], actions[i + 1]) for i in steady]
    if any((f.kind, b.kind) != ("F", "B") for f, b in steps[warmup:]):
        raise ValueError(f"stage {stage}: not an interleaved table (the steady state must alternate F and B)")
    steps += [(a,) for a in actions[warmup + 2 * (total - warmup):]]
    return steps


def p2p_plan(actions: Sequence[Action], stage: int, pp: int, vpp: int = 1, *, v_shape: bool = False,
             tables: Sequence[Sequence[Action]] | None = None) -> list[Step]:
    """The batches ``stage`` posts to run ``actions``: the executor's exact posting order.

    Step ``i`` posts the sends of step ``i - 1``'s results together with the receives of
    step ``i``'s inputs (forward before backward in both), then computes step ``i``; a last
    step flushes the final sends. Each batch is waited for as a whole before its compute,
    which is what NCCL's stream order would impose anyway. ``v_shape``: the pieces are placed
    in a V (:func:`workers.parallel.pipeline.place`). ``tables`` (every stage's, ``actions``
    among them): a receive from a peer first posts the receives of whatever that peer sends
    this stage before it (the peers' send order, not this table's, orders a pair's messages).
    """
    expected: dict[int, list] = defaultdict(list)  # peer -> the messages it sends here, in order
    for peer, table in enumerate(tables or ()):
        for a in table:
            op = _output_of(a, peer, pp, vpp, v_shape)
            if op is not None and op.peer == stage:
                expected[peer].append(op.message)
    posted: set = set()
    steps: list[Step] = []
    pending: list[P2POp] = []
    for group in _compute_steps(actions, stage, pp, vpp):
        recvs = []
        for op in (_input_of(a, stage, pp, vpp, v_shape) for a in group):
            if op is None or op.message in posted:
                continue
            queue = expected.get(op.peer, [op.message])
            ahead = queue[: queue.index(op.message) + 1] if op.message in queue else [op.message]
            recvs += [P2POp("recv", op.peer, m) for m in ahead if m not in posted]
            posted.update(ahead)
        steps.append(Step(tuple(pending + recvs), group))
        pending = [op for op in (_output_of(a, stage, pp, vpp, v_shape) for a in group) if op is not None]
    if pending:
        steps.append(Step(tuple(pending), ()))
    return steps


class Deadlock(ValueError):
    """:func:`simulate_nccl` found the plans stuck: ``steps[stage]`` is each stuck stage's step,
    ``unmatched[stage]`` the indices of its operations there that no peer matched."""

    def __init__(self, message: str, steps: dict[int, int], unmatched: dict[int, list[int]]):
        super().__init__(message)
        self.steps, self.unmatched = steps, unmatched


def simulate_nccl(plans: Sequence[Sequence[Step]], repair: Callable[[Deadlock], set[int]] | None = None) -> int:
    """Run every stage's plan under NCCL's semantics; return the number of rounds.

    Each stage posts its current batch; an operation completes when its counterpart on the
    peer is posted (a send waits for the receive, a receive for the send), matching the
    k-th send of a (sender, receiver) pair with that pair's k-th receive; a stage moves to
    its next batch once every operation of the current one completed. A matched pair must
    carry the same message: nothing (no tag) could tell two messages apart.

    ``repair`` (:func:`plan_all`'s): called at a deadlock, it may rewrite the plans from the
    stuck batches on and returns the stages whose current batch it changed; those are posted
    again and the run goes on (what ran before is unchanged). Nothing changed: the deadlock stands.

    Raises:
        ValueError: a deadlock (naming every stuck stage's pending operations), or a send
            matched with a receive that expects another message.
    """
    pp = len(plans)
    sends: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) -> messages posted
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    slots: list[list[tuple[str, tuple[int, int], int]]] = [[] for _ in range(pp)]
    pos = [0] * pp

    def post(s: int) -> None:
        slots[s] = []
        if pos[s] < len(plans[s]):
            for op in plans[s][pos[s]].ops:
                pair = (s, op.peer) if op.kind == "send" else (op.peer, s)
                queue = sends if op.kind == "send" else recvs
                slots[s].append((op.kind, pair, len(queue[pair])))
                queue[pair].append(op.message)

    def matched(kind: str, pair: tuple[int, int], index: int) -> bool:
        other = recvs if kind == "send" else sends
        if len(other[pair]) <= index:
            return False
        if sends[pair][index] != recvs[pair][index]:
            raise ValueError(
                f"stage {pair[0]} -> {pair[1]}: message #{index} is sent as {sends[pair][index]} but "
                f"received as {recvs[pair][index]}; without tags the pair's order must agree"
            )
        return True

    for s in range(pp):
        post(s)
    rounds = 0
    while any(pos[s] < len(plans[s]) for s in range(pp)):
        done = [s for s in range(pp) if pos[s] < len(plans[s]) and all(matched(*slot) for slot in slots[s])]
        if not done:
            stuck = {s: [(k, p, sends[p][i] if k == "send" else recvs[p][i]) for k, p, i in slots[s]]
                     for s in range(pp) if pos[s] < len(plans[s])}
            unmatched = {s: [j for j, slot in enumerate(slots[s]) if not matched(*slot)] for s in stuck}
            error = Deadlock(f"deadlock after {rounds} rounds under NCCL semantics: stages wait on {stuck}",
                             {s: pos[s] for s in stuck}, unmatched)
            changed = repair(error) if repair is not None else set()
            if not changed:
                raise error
            for s in changed:  # un-post the stage's current batch (the tails of its pairs' queues), post anew
                for kind, pair, index in slots[s]:
                    queue = (sends if kind == "send" else recvs)[pair]
                    del queue[index:]
                post(s)
            continue
        for s in done:  # complete together, then post: a round is one step of every ready stage
            pos[s] += 1
        for s in done:
            post(s)
        rounds += 1
    return rounds


def plan_all(tables: Sequence[Sequence[Action]], vpp: int = 1, v_shape: bool = False) -> list[list[Step]]:
    """Every stage's :func:`p2p_plan`, with sends held back where posting them deadlocks.

    A send blocks until the peer posts the matching receive; when two stages each send what
    the other receives only later (ZBV's gradients cross at stage pairs), neither gets there.
    Each such unmatched send (with the later sends to the same peer up to there: a pair's order
    stays) moves to the front of the stage's next batch that receives from that peer, to be
    posted with it (Megatron's ``send_backward_recv_forward``), while :func:`simulate_nccl` runs
    the plans (it resumes after each repair); the 1F1B, interleaved and ZB-H1 plans never need it.

    Raises:
        ValueError: a deadlock no holding back resolves, or messages mixed up.
    """
    pp = len(tables)
    plans = [p2p_plan(t, s, pp, vpp, v_shape=v_shape, tables=tables) for s, t in enumerate(tables)]

    def repair(e: Deadlock) -> set[int]:
        changed = set()
        for s, i in e.steps.items():
            ops = plans[s][i].ops
            late = [ops[j] for j in e.unmatched[s] if ops[j].kind == "send"]
            for peer in sorted({op.peer for op in late}):
                first = next(op for op in late if op.peer == peer)
                _hold(plans[s], i, plans[s][i].ops.index(first), peer)
                changed.add(s)
        return changed

    simulate_nccl(plans, repair)
    return plans


def _hold(plan: list[Step], i: int, first: int, peer: int) -> None:
    """Move step ``i``'s sends to ``peer`` from its ``first`` operation on, and those of the
    following steps, in order, to the front of the next step that receives from ``peer``."""
    j = next((k for k in range(i + 1, len(plan)) if any(op.kind == "recv" and op.peer == peer for op in plan[k].ops)),
             None)
    if j is None:
        plan.append(Step((), ()))
        j = len(plan) - 1

    def held(k: int, n: int, op: P2POp) -> bool:
        return op.kind == "send" and op.peer == peer and (k > i or n >= first)

    moving = [op for k in range(i, j) for n, op in enumerate(plan[k].ops) if held(k, n, op)]
    for k in range(i, j):
        plan[k] = Step(tuple(op for n, op in enumerate(plan[k].ops) if not held(k, n, op)), plan[k].actions)
    plan[j] = Step(tuple(moving) + plan[j].ops, plan[j].actions)


def check_nccl_safe(num_microbatches: int, pp: int, vpp: int | None = None, *, forward_only: bool = False,
                    name: str | None = None) -> int:
    """Build every stage's table (of schedule ``name``, default by ``vpp``) and plan, simulate
    them under NCCL; return the rounds.

    Raises:
        ValueError: the plans deadlock or pair messages wrongly.
    """
    chunks = vpp or 1
    make = schedule_forward_only if forward_only else schedule
    tables = [make(num_microbatches, pp, vpp, s, name) for s in range(pp)]
    return simulate_nccl(plan_all(tables, chunks, name in V_SHAPED))
