"""Pipeline parallelism as pure tables: layer partition, 1F1B and interleaved schedules.

A pipeline schedule is a list of :class:`Action` per stage, ``F`` (forward) or ``B``
(backward) of one (microbatch, model chunk); the zero-bubble schedules
(:mod:`workers.parallel.pipeline_zb`) split each backward into ``B`` (input gradient) and
``W`` (weight gradient). :func:`schedule` picks the table by ``parallel.pipeline_schedule``. The tables are plain Python over integers, so
they can be checked exhaustively (every pair run once, no deadlock, bounded memory) for
pipelines far larger than any test can spawn; :mod:`workers.parallel.pipeline_p2p` derives
the exact point-to-point posting order from a table and proves it safe under NCCL's
semantics, and :mod:`workers.parallel.pipeline_exec` runs that order with real tensors.

Virtual stages (Megatron's interleaving): with ``vpp`` model chunks per stage, the model is cut
into ``pp * vpp`` consecutive pieces and piece ``v = chunk * pp + stage`` lives on ``stage``.
An activation therefore travels stage 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ...; the
bubble shrinks by ``vpp`` at the cost of ``vpp`` times more point-to-point messages. The V
shape (``zbv``, two chunks) places piece ``v`` on stage ``v`` going down and on stage
``2 pp - 1 - v`` coming back (:func:`place`): stage 0 holds the first and the last piece.

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.parallel import pipeline_zb


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule.

    Attributes:
        kind: ``"F"`` (forward), ``"B"`` (backward; in a zero-bubble table only the input
            gradient) or ``"W"`` (the weight gradient deferred from ``B``, zero-bubble tables).
        microbatch: microbatch index, ``0 <= microbatch < num_microbatches``.
        chunk: model chunk on this stage, ``0 <= chunk < vpp``.
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
"""The values of ``parallel.pipeline_schedule``."""

V_SHAPED = ("zbv",)
"""Schedules whose two chunks per stage are placed in a V (:func:`place`)."""


def default_schedule(vpp: int | None) -> str:
    """``parallel.pipeline_schedule`` when unset: today's choice, interleaved iff ``vpp > 1``."""
    return "interleaved" if vpp is not None and vpp > 1 else "1f1b"


def virtual_stage(stage: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """The model piece chunk ``chunk`` of ``stage`` runs: ``chunk * pp + stage``, or in the V
    shape ``stage`` (chunk 0) and ``2 pp - 1 - stage`` (chunk 1)."""
    if v_shape and chunk == 1:
        return 2 * pp - 1 - stage
    return chunk * pp + stage


def place(v: int, pp: int, v_shape: bool = False) -> tuple[int, int]:
    """(stage, chunk) of virtual stage ``v``: the inverse of :func:`virtual_stage`."""
    chunk, stage = divmod(v, pp)
    if v_shape and chunk == 1:
        stage = pp - 1 - stage
    return stage, chunk


def _check_sizes(num_microbatches: int, pp: int, stage: int, vpp: int = 1) -> None:
    if pp < 1:
        raise ValueError(f"pipeline_model_parallel_size must be >= 1, got {pp}")
    if vpp < 1:
        raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1, got {vpp}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} is outside 0..{pp - 1}")


def partition_layers(num_layers: int, pp: int, vpp: int | None = None, v_shape: bool = False) -> list[list[list[int]]]:
    """Assign global layer indices to (stage, chunk), Megatron's interleaved way.

    Virtual stage ``v = chunk * pp + stage`` holds layers ``[v * n, (v + 1) * n)`` with
    ``n = num_layers / (pp * vpp)``. So with pp=2, vpp=2, 8 layers, stage 0 holds layers
    0-1 (chunk 0) and 4-5 (chunk 1).

    Args:
        num_layers: transformer layers in the whole model.
        pp: pipeline-parallel size.
        vpp: model chunks per stage; ``None`` means one (no interleaving).
        v_shape: place the pieces in a V (:func:`place`; two chunks).

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
    return [[list(range(v * n, (v + 1) * n)) for v in (virtual_stage(s, c, pp, v_shape) for c in range(chunks))]
            for s in range(pp)]


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


def schedule(num_microbatches: int, pp: int, vpp: int | None, stage: int, name: str | None = None) -> list[Action]:
    """The schedule a stage runs: ``name`` (one of :data:`SCHEDULES`), by default
    :func:`default_schedule` (interleaved when ``vpp > 1``, else 1F1B).

    With ``pp == 1`` this is plain gradient accumulation, F0 B0 F1 B1 ...
    """
    name = name or default_schedule(vpp)
    if name in ("zb-h1", "zbv"):
        _check_sizes(num_microbatches, pp, stage, vpp or 1)
        return [Action(*a) for a in pipeline_zb.schedule_zb(name, num_microbatches, pp, vpp, stage)]
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if (name == "interleaved") != (vpp is not None and vpp > 1):
        raise ValueError(f"pipeline_schedule {name} with virtual_pipeline_model_parallel_size {vpp}: interleaved "
                         "needs vpp > 1 and 1f1b no vpp; unset pipeline_schedule")
    if vpp is not None and vpp > 1:
        if pp == 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1: unset it"
            )
        return schedule_interleaved(num_microbatches, pp, vpp, stage)
    return schedule_1f1b(num_microbatches, pp, stage)


def schedule_forward_only(num_microbatches: int, pp: int, vpp: int | None, stage: int,
                          name: str | None = None) -> list[Action]:
    """The forwards of :func:`schedule`, in its order, and no backward (evaluation).

    As Megatron's ``forward_only`` schedules: 1F1B's forwards are microbatch order; the
    interleaved ones walk the chunks in groups of ``pp`` microbatches. ZB-H1's are 1F1B's;
    the V schedule's run chunk 0 of every microbatch, then chunk 1.
    """
    if name in V_SHAPED:  # no activation is kept: every microbatch down, then every one back up
        return [Action("F", mb, c) for c in (0, 1) for mb in range(num_microbatches)]
    if name == "zb-h1":
        name = "1f1b"
    return [a for a in schedule(num_microbatches, pp, vpp, stage, name) if a.kind == "F"]


def in_flight_bound(num_microbatches: int, pp: int, vpp: int | None, stage: int, name: str | None = None) -> int:
    """Most (microbatch, chunk) activations ``stage`` may hold at once under :func:`schedule`
    (for the zero-bubble tables: forwarded, weight gradient not yet run)."""
    if name in ("zb-h1", "zbv"):
        return pipeline_zb.in_flight_bound_zb(name, num_microbatches, pp, stage)
    if vpp is not None and vpp > 1:
        return interleaved_warmup(num_microbatches, pp, vpp, stage) + 1
    return min(pp - stage, num_microbatches)
