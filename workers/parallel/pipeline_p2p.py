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

Nothing here imports torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from workers.parallel.pipeline import Action, interleaved_warmup, schedule, schedule_forward_only


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


def _input_of(a: Action, stage: int, pp: int, vpp: int) -> P2POp | None:
    """The receive an action needs first (None on the first / last virtual stage)."""
    v, last = a.chunk * pp + stage, pp * vpp - 1
    if a.kind == "F":
        return None if v == 0 else P2POp("recv", (stage - 1) % pp, ("F", a.microbatch, v - 1))
    return None if v == last else P2POp("recv", (stage + 1) % pp, ("B", a.microbatch, v + 1))


def _output_of(a: Action, stage: int, pp: int, vpp: int) -> P2POp | None:
    """The send an action's result needs (None on the last / first virtual stage)."""
    v, last = a.chunk * pp + stage, pp * vpp - 1
    if a.kind == "F":
        return None if v == last else P2POp("send", (stage + 1) % pp, ("F", a.microbatch, v))
    return None if v == 0 else P2POp("send", (stage - 1) % pp, ("B", a.microbatch, v))


def _compute_steps(actions: Sequence[Action], stage: int, pp: int, vpp: int) -> list[tuple[Action, ...]]:
    """Group the table into compute steps with no communication inside a step.

    1F1B (``vpp == 1``): one action per step. Interleaved: each steady-state (forward,
    backward) pair is one step, as in Megatron's interleaved schedule, which runs both and
    then exchanges all four tensors in one batch (posting the forward's send before the
    backward's receive deadlocks under NCCL for every vpp > 1); warm-up forwards and
    cool-down backwards stay single.
    """
    if vpp == 1 or all(a.kind == "F" for a in actions):  # 1F1B, or forward-only (evaluation)
        return [(a,) for a in actions]
    total = len(actions) // 2
    warmup = interleaved_warmup(total // vpp, pp, vpp, stage)
    steady = range(warmup, warmup + 2 * (total - warmup), 2)
    steps = [(a,) for a in actions[:warmup]]
    steps += [(actions[i], actions[i + 1]) for i in steady]
    if any((f.kind, b.kind) != ("F", "B") for f, b in steps[warmup:]):
        raise ValueError(f"stage {stage}: not an interleaved table (the steady state must alternate F and B)")
    steps += [(a,) for a in actions[warmup + 2 * (total - warmup):]]
    return steps


def p2p_plan(actions: Sequence[Action], stage: int, pp: int, vpp: int = 1) -> list[Step]:
    """The batches ``stage`` posts to run ``actions``: the executor's exact posting order.

    Step ``i`` posts the sends of step ``i - 1``'s results together with the receives of
    step ``i``'s inputs (forward before backward in both), then computes step ``i``; a last
    step flushes the final sends. Each batch is waited for as a whole before its compute,
    which is what NCCL's stream order would impose anyway.
    """
    steps: list[Step] = []
    pending: list[P2POp] = []
    for group in _compute_steps(actions, stage, pp, vpp):
        recvs = [op for op in (_input_of(a, stage, pp, vpp) for a in group) if op is not None]
        steps.append(Step(tuple(pending + recvs), group))
        pending = [op for op in (_output_of(a, stage, pp, vpp) for a in group) if op is not None]
    if pending:
        steps.append(Step(tuple(pending), ()))
    return steps


def simulate_nccl(plans: Sequence[Sequence[Step]]) -> int:
    """Run every stage's plan under NCCL's semantics; return the number of rounds.

    Each stage posts its current batch; an operation completes when its counterpart on the
    peer is posted (a send waits for the receive, a receive for the send), matching the
    k-th send of a (sender, receiver) pair with that pair's k-th receive; a stage moves to
    its next batch once every operation of the current one completed. A matched pair must
    carry the same message: nothing (no tag) could tell two messages apart.

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
            raise ValueError(f"deadlock after {rounds} rounds under NCCL semantics: stages wait on {stuck}")
        for s in done:  # complete together, then post: a round is one step of every ready stage
            pos[s] += 1
        for s in done:
            post(s)
        rounds += 1
    return rounds


def check_nccl_safe(num_microbatches: int, pp: int, vpp: int | None = None, *, forward_only: bool = False) -> int:
    """Build every stage's table and plan, simulate them under NCCL; return the rounds.

    Raises:
        ValueError: the plans deadlock or pair messages wrongly.
    """
    chunks = vpp or 1
    make = schedule_forward_only if forward_only else schedule
    plans = [p2p_plan(make(num_microbatches, pp, vpp, s), s, pp, chunks) for s in range(pp)]
    return simulate_nccl(plans)
