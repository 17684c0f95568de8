"""Pipeline parallelism as pure tables: layer partition, 1F1B and interleaved schedules.

A pipeline schedule is a list of :class:`Action` per stage, ``F`` (forward) or ``B``
(backward) of one (microbatch, model chunk). The tables are plain Python over integers, so
they can be checked exhaustively (every pair run once, no deadlock, bounded memory) for
pipelines far larger than any test can spawn; :mod:`workers.parallel.pipeline_p2p` derives
the exact point-to-point posting order from a table and proves it safe under NCCL's
semantics, and :mod:`workers.parallel.pipeline_exec` runs that order with real tensors.

Virtual stages (Megatron's interleaving): with ``vpp`` model chunks per stage, the model is cut
into ``pp * vpp`` consecutive pieces and piece ``v = chunk * pp + stage`` lives on ``stage``.
An activation therefore travels stage 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ...; the
bubble shrinks by ``vpp`` at the cost of ``vpp`` times more point-to-point messages.

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule.

    Attributes:
        kind: ``"F"`` (forward) or ``"B"`` (backward).
        microbatch: microbatch index, ``0 <= microbatch < num_microbatches``.
        chunk: model chunk on this stage, ``0 <= chunk < vpp``.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


def _check_sizes(num_microbatches: int, pp: int, stage: int, vpp: int = 1) -> None:
    if pp < 1:
        raise ValueError(f"pipeline_model_parallel_size must be >= 1, got {pp}")
    if vpp < 1:
        raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1, got {vpp}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} is outside 0..{pp - 1}")


def partition_layers(num_layers: int, pp: int, vpp: int | None = None) -> list[list[list[int]]]:
    """Assign global layer indices to (stage, chunk), Megatron's interleaved way.

    Virtual stage ``v = chunk * pp + stage`` holds layers ``[v * n, (v + 1) * n)`` with
    ``n = num_layers / (pp * vpp)``. So with pp=2, vpp=2, 8 layers, stage 0 holds layers
    0-1 (chunk 0) and 4-5 (chunk 1).

    Args:
        num_layers: transformer layers in the whole model.
        pp: pipeline-parallel size.
        vpp: model chunks per stage; ``None`` means one (no interleaving).

    Returns:
        ``layers[stage][chunk]`` = list of global layer indices.

    Raises:
        ValueError: layers not divisible by ``pp * vpp``, or ``vpp`` without pipelining.
    """
    if vpp is not None and pp == 1:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
            "(got 1): unset it or raise pipeline_model_parallel_size"
        )
    chunks = 1 if vpp is None else vpp
    _check_sizes(1, pp, 0, chunks)
    if num_layers % (pp * chunks):
        raise ValueError(
            f"num_layers {num_layers} is not divisible by pipeline_model_parallel_size({pp}) x "
            f"virtual_pipeline_model_parallel_size({chunks}) = {pp * chunks}: choose num_layers a "
            f"multiple of {pp * chunks} or change pp/vpp"
        )
    n = num_layers // (pp * chunks)
    return [[list(range((c * pp + s) * n, (c * pp + s + 1) * n)) for c in range(chunks)] for s in range(pp)]


def schedule_1f1b(num_microbatches: int, pp: int, stage: int) -> list[Action]:
    """Megatron's non-interleaved one-forward-one-backward schedule for one stage.

    Warm-up runs ``min(pp - stage - 1, m)`` forwards (enough to fill the pipeline below this
    stage), the steady state alternates F and B, and the cool-down drains the backwards. A
    stage therefore never holds more than ``pp - stage`` microbatches' activations, unlike
    GPipe's ``m``.
    """
    _check_sizes(num_microbatches, pp, stage)
    m = num_microbatches
    warmup = min(pp - stage - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions


def interleaved_warmup(num_microbatches: int, pp: int, vpp: int, stage: int) -> int:
    """Forward steps the interleaved schedule runs before its first backward on ``stage``.

    Current Megatron's rule for every microbatch count; its old special case (``m == pp``:
    every forward is warm-up) was dropped there and here.
    """
    return min((pp - stage - 1) * 2 + (vpp - 1) * pp, num_microbatches * vpp)


def _virtual(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward or backward step of the interleaved schedule."""
    group, pos = divmod(k, pp * vpp)
    chunk = pos // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return group * pp + k % pp, chunk


def schedule_interleaved(num_microbatches: int, pp: int, vpp: int, stage: int) -> list[Action]:
    """Megatron's interleaved 1F1B schedule for one stage with ``vpp`` model chunks.

    Microbatches go through the chunks in groups of ``pp``: forwards of microbatches 0..pp-1 on
    chunk 0, then the same on chunk 1, ..., then the next ``pp`` microbatches. Backwards walk
    the chunks in reverse. Warm-up is ``(pp - stage - 1) * 2 + (vpp - 1) * pp`` forwards.

    Raises:
        ValueError: ``num_microbatches`` not a multiple of ``pp`` (Megatron's requirement).
    """
    _check_sizes(num_microbatches, pp, stage, vpp)
    if num_microbatches % pp:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a multiple "
            f"of pipeline_model_parallel_size ({pp}): change global_batch_size / micro_batch_size / dp "
            "or unset virtual_pipeline_model_parallel_size"
        )
    total = num_microbatches * vpp
    warmup = interleaved_warmup(num_microbatches, pp, vpp, stage)

    def f(k: int) -> Action:
        return Action("F", *_virtual(k, pp, vpp, True))

    def b(k: int) -> Action:
        return Action("B", *_virtual(k, pp, vpp, False))

    actions = [f(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [f(warmup + k), b(k)]
    actions += [b(k) for k in range(total - warmup, total)]
    return actions


def schedule(num_microbatches: int, pp: int, vpp: int | None, stage: int) -> list[Action]:
    """The schedule a stage runs: interleaved when ``vpp > 1``, else 1F1B.

    With ``pp == 1`` this is plain gradient accumulation, F0 B0 F1 B1 ...
    """
    if vpp is not None and vpp > 1:
        if pp == 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1: unset it"
            )
        return schedule_interleaved(num_microbatches, pp, vpp, stage)
    return schedule_1f1b(num_microbatches, pp, stage)


def schedule_forward_only(num_microbatches: int, pp: int, vpp: int | None, stage: int) -> list[Action]:
    """The forwards of :func:`schedule`, in its order, and no backward (evaluation).

    As Megatron's ``forward_only`` schedules: 1F1B's forwards are microbatch order; the
    interleaved ones walk the chunks in groups of ``pp`` microbatches.
    """
    return [a for a in schedule(num_microbatches, pp, vpp, stage) if a.kind == "F"]


def in_flight_bound(num_microbatches: int, pp: int, vpp: int | None, stage: int) -> int:
    """Most (microbatch, chunk) activations ``stage`` may hold at once under :func:`schedule`."""
    if vpp is not None and vpp > 1:
        return interleaved_warmup(num_microbatches, pp, vpp, stage) + 1
    return min(pp - stage, num_microbatches)


# ----------------------------------------------------------------------------- checkers


def check_stage(actions: Sequence[Action], num_microbatches: int, vpp: int = 1) -> None:
    """Every (microbatch, chunk) is run forward once and backward once, backward after forward.

    Raises:
        ValueError: naming the first offending action.
    """
    done_f: set[tuple[int, int]] = set()
    done_b: set[tuple[int, int]] = set()
    for i, a in enumerate(actions):
        key = (a.microbatch, a.chunk)
        if a.kind not in ("F", "B") or not (0 <= a.microbatch < num_microbatches and 0 <= a.chunk < vpp):
            raise ValueError(f"step {i}: invalid action {a!r}")
        seen = done_f if a.kind == "F" else done_b
        if key in seen:
            raise ValueError(f"step {i}: {a!r} runs twice")
        if a.kind == "B" and key not in done_f:
            raise ValueError(f"step {i}: {a!r} runs before its forward")
        seen.add(key)
    expected = num_microbatches * vpp
    if len(done_f) != expected or len(done_b) != expected:
        raise ValueError(f"{len(done_f)} forwards and {len(done_b)} backwards, expected {expected} each")


def max_in_flight(actions: Sequence[Action]) -> int:
    """Peak number of (microbatch, chunk) pairs forwarded but not yet backwarded."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(tables: Sequence[Sequence[Action]], vpp: int = 1) -> int:
    """Run all stages' tables in lock step with unit-time actions; return the makespan.

    At each time step every stage runs its next action if its inputs were produced in an
    earlier step: F of virtual stage ``v`` needs F of ``v - 1`` (same microbatch), B of ``v``
    needs B of ``v + 1`` and its own F. Sends never block, receives do: the dependency
    structure of the table alone (a buffering transport such as gloo).
    :func:`workers.parallel.pipeline_p2p.simulate_nccl` checks the executor's actual posting
    order under NCCL's stricter rules.

    Raises:
        ValueError: the tables deadlock (names each stuck stage's next action).
    """
    pp = len(tables)
    last = pp * vpp - 1
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage)
    pos = [0] * pp
    remaining = sum(len(t) for t in tables)
    t = 0
    while remaining:
        ready = []
        for s, table in enumerate(tables):
            if pos[s] == len(table):
                continue
            a = table[pos[s]]
            v = a.chunk * pp + s
            if a.kind == "F":
                ok = v == 0 or ("F", a.microbatch, v - 1) in done
            else:
                ok = ("F", a.microbatch, v) in done and (v == last or ("B", a.microbatch, v + 1) in done)
            if ok:
                ready.append((s, (a.kind, a.microbatch, v)))
        if not ready:
            stuck = {s: tables[s][pos[s]] for s in range(pp) if pos[s] < len(tables[s])}
            raise ValueError(f"deadlock at step {t}: stages wait on {stuck}")
        for s, key in ready:  # commit after the scan: results are visible from the next step
            done.add(key)
            pos[s] += 1
        remaining -= len(ready)
        t += 1
    return t


def check_message_order(tables: Sequence[Sequence[Action]], vpp: int = 1) -> None:
    """Each rank pair's messages are received in the order they are sent.

    No backend here uses tags, so a pair's messages are matched by posting order; Megatron's
    tables satisfy this.

    Raises:
        ValueError: naming the first pair (sender, receiver) whose orders differ.
    """
    pp = len(tables)
    last = pp * vpp - 1
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for s, table in enumerate(tables):
        up, down = (s - 1) % pp, (s + 1) % pp
        for a in table:
            v = a.chunk * pp + s
            if a.kind == "F":
                if v > 0:
                    received.setdefault((up, s), []).append(("F", a.microbatch, v - 1))
                if v < last:
                    sent.setdefault((s, down), []).append(("F", a.microbatch, v))
            else:
                if v < last:
                    received.setdefault((down, s), []).append(("B", a.microbatch, v + 1))
                if v > 0:
                    sent.setdefault((s, up), []).append(("B", a.microbatch, v))
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair) != received.get(pair):
            raise ValueError(f"stage {pair[0]} -> {pair[1]}: sends {sent.get(pair)} but receives {received.get(pair)}")


def check_schedule(num_microbatches: int, pp: int, vpp: int | None = None) -> int:
    """Build every stage's table and check it fully; return the simulated makespan.

    Raises:
        ValueError: a table misses or repeats work, deadlocks, exceeds its memory bound, or
            receives a pair's messages in another order than they were sent.
    """
    chunks = 1 if vpp is None else vpp
    tables = [schedule(num_microbatches, pp, vpp, s) for s in range(pp)]
    for s, table in enumerate(tables):
        check_stage(table, num_microbatches, chunks)
        peak, bound = max_in_flight(table), in_flight_bound(num_microbatches, pp, vpp, s)
        if peak > bound:
            raise ValueError(f"stage {s} holds {peak} activations at once, bound {bound}")
    check_message_order(tables, chunks)
    return simulate(tables, chunks)
