"""Zero-bubble pipeline tables: ZB-H1 and the V-shaped ZBV (Qi et al., "Zero Bubble Pipeline
Parallelism"; the same tables as torchtitan / ``torch.distributed.pipelining``).

Each backward is split into ``B``, the input gradient the previous stage waits for, and
``W``, the weight gradient nobody waits for (:mod:`workers.parallel.wgrad` defers the linear
layers' weight-gradient GEMMs from ``B`` to ``W``). A stage runs its ``B`` as soon as it can
and fills the time it would wait with ``W``: with ``F``, ``B`` and ``W`` of equal cost,
1F1B's bubble ``(pp - 1)(F + B + W)`` becomes ``(pp - 1)(F + B - W)`` for ZB-H1, whose
activation memory is 1F1B's, and close to nothing for ZBV.

* **ZB-H1** (``zb-h1``, one chunk per stage): 1F1B's warm-up and steady state with stage
  ``s`` keeping up to ``s`` weight gradients pending: the later stages run their ``B`` early,
  so the input gradients reach stage 0 sooner, and catch up on their ``W`` at the end, when
  1F1B would leave them idle. Bubble ``(pp - 1)(F + B - W)``; a stage holds at most ``pp``
  microbatches' activations (1F1B: ``pp - s``).
* **ZBV** (``zbv``, two chunks per stage placed in a V, :func:`workers.parallel.pipeline.place`):
  stage ``s`` runs pieces ``s`` and ``2 pp - 1 - s``; stage 0 both embeds and computes the
  loss, and the turn at stage ``pp - 1`` is a local hand-over, no message.

The tables are lists of ``(kind, microbatch, chunk)`` tuples: :func:`workers.parallel.pipeline.schedule`
(which checks the sizes first) makes them :class:`workers.parallel.pipeline.Action` lists.
Nothing here imports torch, or the rest of the pipeline.
"""

from __future__ import annotations

Entry = tuple[str, int, int]
"""(kind, microbatch, chunk) of one step."""


def _a(kind: str, microbatch: int, chunk: int = 0) -> Entry:
    return (kind, microbatch, chunk)


def schedule_zbh1(num_microbatches: int, pp: int, stage: int) -> list[Entry]:
    """ZB-H1 for one stage: 1F1B whose stage ``s`` keeps up to ``s`` weight gradients pending."""
    m = num_microbatches
    warmup = min(pp - stage - 1, m)
    actions = [_a("F", i) for i in range(warmup)]
    w = 0
    for i in range(m):
        if warmup + i < m:
            actions.append(_a("F", warmup + i))
        actions.append(_a("B", i))
        if i + 1 - w > stage:  # more than `stage` weight gradients pending: run the oldest
            actions.append(_a("W", w))
            w += 1
    return actions + [_a("W", i) for i in range(w, m)]


def schedule_zbv(num_microbatches: int, pp: int, stage: int) -> list[Entry]:
    """ZBV for one stage (torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` table);
    chunk 0 is piece ``stage``, chunk 1 piece ``2 pp - 1 - stage``.

    Raises:
        ValueError: fewer than ``2 pp`` microbatches (:func:`check_zbv_microbatches`).
    """
    check_zbv_microbatches(num_microbatches, pp)
    m, s = num_microbatches, stage
    acts: list[Entry] = []
    f0 = f1 = b0 = b1 = 0

    def add(kind: str, mb: int, chunk: int) -> None:
        acts.append(_a(kind, mb, chunk))

    for _ in range(2 * (pp - s) - 1):  # warm-up: fill the way down
        add("F", f0, 0)
        f0 += 1
    for _ in range(s):
        add("F", f1, 1)
        f1 += 1
        add("F", f0, 0)
        f0 += 1
    for _ in range(pp - s):
        add("F", f1, 1)
        f1 += 1
        add("B", b1, 1)
        add("W", b1, 1)
        b1 += 1
    while f1 < f0 or f0 < m:  # steady state
        if f0 < m:
            add("F", f0, 0)
            f0 += 1
        add("B", b0, 0)
        add("W", b0, 0)
        b0 += 1
        add("F", f1, 1)
        f1 += 1
        add("B", b1, 1)
        add("W", b1, 1)
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(s):  # cool-down
        add("B", b0, 0)
        b0 += 1
        add("B", b1, 1)
        b1 += 1
    for _ in range(pp - s):
        add("B", b0, 0)
        b0 += 1
        add("W", w0, 0)
        w0 += 1
    for i in range(w1, b1):
        add("W", i, 1)
    for i in range(w0, b0):
        add("W", i, 0)
    return acts


def check_zbv_microbatches(num_microbatches: int, pp: int) -> None:
    """The V table needs ``num_microbatches >= 2 pp`` (its warm-up alone runs ``2 pp - 1``)."""
    if num_microbatches < 2 * pp:
        raise ValueError(
            f"the zbv schedule needs num_microbatches ({num_microbatches}) >= 2 x pipeline_model_parallel_size "
            f"({2 * pp}): raise global_batch_size / lower micro_batch_size or use pipeline_schedule zb-h1")


def schedule_zb(name: str, num_microbatches: int, pp: int, vpp: int | None, stage: int) -> list[Entry]:
    """The zero-bubble table ``name`` (``zb-h1`` or ``zbv``) of ``stage``.

    Raises:
        ValueError: a combination the table cannot run, naming the fields and the fix.
    """
    if pp < 2:
        raise ValueError(f"pipeline_schedule {name} needs pipeline_model_parallel_size > 1 (got {pp}): unset "
                         "pipeline_schedule")
    if name == "zb-h1":
        if vpp is not None and vpp > 1:
            raise ValueError(f"pipeline_schedule zb-h1 runs one chunk per stage, not virtual_pipeline_model_parallel_size "
                             f"{vpp}: unset vpp or use pipeline_schedule zbv with vpp 2")
        return schedule_zbh1(num_microbatches, pp, stage)
    if vpp != 2:
        raise ValueError(f"pipeline_schedule zbv needs virtual_pipeline_model_parallel_size 2 (got {vpp}): set vpp "
                         "to 2 or use pipeline_schedule zb-h1")
    return schedule_zbv(num_microbatches, pp, stage)


def in_flight_bound_zb(name: str, num_microbatches: int, pp: int, stage: int) -> int:
    """Most (microbatch, chunk) pairs ``stage`` holds (forwarded, ``W`` not yet run)."""
    if name == "zb-h1":
        return min(pp, num_microbatches)
    return 2 * pp
