"""Run a pipeline schedule table (see :mod:`workers.parallel.pipeline`) with real tensors.

One call runs one iteration's forwards and backwards on one stage. Activations and their
gradients travel between neighbouring stages with point-to-point messages through
:func:`workers.parallel.comm.p2p`:

* a forward receives the activation of the previous virtual stage, runs the chunk and sends
  its output to the next virtual stage;
* a backward receives the output gradient from the next virtual stage (on the last virtual
  stage it backpropagates the loss instead) and sends the input gradient back.

The order in which messages are posted is :func:`workers.parallel.pipeline_p2p.p2p_plan`'s,
so :func:`workers.parallel.pipeline_p2p.simulate_nccl` checks exactly what runs here: each
step's sends and receives are posted together in one ``batch_isend_irecv`` and waited for as a
whole before the step computes. No tag is used: NCCL ignores tags and matches a pair's
messages in posting order, and the simulator proves that order agrees on both sides.

Zero-bubble tables (:mod:`workers.parallel.pipeline_zb`): a ``B`` runs the backward inside
:func:`workers.parallel.wgrad.deferred_wgrads`, and the matching ``W`` runs the weight-gradient
GEMMs it queued. In the V shape the hand-over between the two chunks of stage ``pp - 1`` stays
local, and the loss is computed on stage 0. ``timeline`` records each action's start and end
(``time.perf_counter``), from which :mod:`bench.pipeline_bench` measures the bubble.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Sequence

import torch

from workers.parallel import comm
from workers.parallel.pipeline import Action, place, virtual_stage
from workers.parallel.pipeline_p2p import Step, p2p_plan
from workers.parallel.wgrad import deferred_wgrads, run_wgrads


def deallocate_output(out: torch.Tensor) -> None:
    """Megatron's ``deallocate_output_tensor``: once a stage's output is handed to the send, only its
    graph is needed for the backward, not its data; swap the data for one element so that the
    in-flight microbatches of 1F1B hold no second copy of their outputs (the message's own reference
    keeps the data alive until it is sent). A view is left alone (its base holds the storage)."""
    if out._base is None:
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """Megatron's ``custom_backward``: backpropagate ``grad_output`` from ``output`` through the C++
    autograd engine directly. ``torch.autograd.backward`` would check the output's shape, which
    :func:`deallocate_output` has emptied, and it imports ``torch.fx``'s symbolic shapes (sympy:
    ~32 MB resident in every stage but the last, measured) to compare the two."""
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


def run_pipeline(
    actions: Sequence[Action],
    *,
    stage: int,
    pp: int,
    vpp: int,
    pp_ranks: Sequence[int],
    chunks: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    num_microbatches: int,
    get_input: Callable[[int], torch.Tensor],
    loss_fn: Callable[[int, torch.Tensor], torch.Tensor],
    tensor_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    group=None,
    device: torch.device | str | None = None,
    before_last_backward: Callable[[int], None] | None = None,
    forward_only: bool = False,
    v_shape: bool = False,
    plan: Sequence[Step] | None = None,
    timeline: list | None = None,
) -> list[torch.Tensor]:
    """Run one stage's schedule: forwards, backwards and the p2p traffic between them.

    Parameter gradients accumulate into the chunks' ``.grad`` as usual; reducing them over data
    parallelism and stepping the optimizer is the caller's job.

    Args:
        actions: this stage's table, e.g. ``pipeline.schedule(m, pp, vpp, stage)``.
        stage: this rank's pipeline stage, ``0 <= stage < pp``.
        pp: pipeline-parallel size.
        vpp: model chunks per stage (1 without interleaving).
        pp_ranks: global ranks of this pipeline group, in stage order.
        chunks: ``chunks[c]`` runs model chunk ``c`` of this stage (virtual stage
            ``c * pp + stage``).
        num_microbatches: microbatches in this iteration.
        get_input: ``get_input(mb)`` is the first virtual stage's input (called on stage 0 only).
        loss_fn: ``loss_fn(mb, output)`` turns the last virtual stage's output into the scalar
            to backpropagate; the caller scales it (e.g. by ``1 / num_microbatches``).
        tensor_shape: shape of every activation passed between stages, e.g.
            ``[seq / (tp if SP) / cp, micro_batch, hidden]``.
        dtype: activation dtype.
        group: the pipeline process group (byte accounting; peers are global ranks).
        device: where receive buffers live; default CPU.
        before_last_backward: ``before_last_backward(chunk)`` is called just before the last
            backward of each model chunk, so that the data-parallel reduction of that chunk's
            gradients (final after it) can overlap with the backwards still to come, with
            interleaving as without (Megatron enables a chunk's grad sync on its last
            microbatch); with ``W`` actions the linear weights are final at their last ``W``
            (:mod:`workers.parallel.wgrad` keeps their hooks from marking them before).
        v_shape: the chunks are placed in a V (:func:`workers.parallel.pipeline.place`).
        plan: the posting order, default ``p2p_plan(actions, ...)``; the V schedule needs
            :func:`workers.parallel.pipeline_p2p.plan_all`'s.
        timeline: if given, ``(kind, microbatch, chunk, start, end, cpu)`` of every action is
            appended: wall-clock start and end (``time.perf_counter``) and the thread's CPU seconds.

    Returns:
        On the stage of the last virtual stage (the last stage; stage 0 in the V shape), the
        detached loss of each microbatch in microbatch order; elsewhere an empty list.

    Raises:
        ValueError: sizes that do not agree, or a chunk output not of ``tensor_shape``.
    """
    if len(pp_ranks) != pp or len(chunks) != vpp or not 0 <= stage < pp:
        raise ValueError(
            f"run_pipeline: stage {stage}, pp {pp}, vpp {vpp} need len(pp_ranks) == pp (got "
            f"{len(pp_ranks)}) and len(chunks) == vpp (got {len(chunks)})"
        )
    shape = tuple(tensor_shape)
    last = pp * vpp - 1
    split = any(a.kind == "W" for a in actions)
    wgrads: dict[tuple[int, int], list] = {}
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    losses: dict[int, torch.Tensor] = {}
    received: dict[tuple[str, int, int], torch.Tensor] = {}
    outgoing: dict[tuple[str, int, int], torch.Tensor] = {}
    last_backward = {a.chunk: a.microbatch for a in actions if a.kind == "B"}  # the last one wins

    def local(v: int) -> bool:
        """Whether virtual stage ``v`` exists and runs on this stage (the V's turn)."""
        return 0 <= v <= last and place(v, pp, v_shape)[0] == stage

    def exchange(ops) -> None:
        if not ops:
            return
        sends, recvs = [], []
        for op in ops:
            peer = pp_ranks[op.peer]
            if op.kind == "send":
                sends.append((outgoing.pop(op.message), peer))
            else:
                received[op.message] = buf = torch.empty(shape, dtype=dtype, device=device)
                recvs.append((buf, peer))
        # One batch, waited as a whole: exactly the model simulate_nccl proves deadlock-free.
        for work in comm.p2p(sends, recvs, group):
            work.wait()

    def forward(a: Action) -> None:
        mb, v = a.microbatch, virtual_stage(stage, a.chunk, pp, v_shape)
        x = get_input(mb) if v == 0 else received.pop(("F", mb, v - 1)).requires_grad_()
        y = chunks[a.chunk](x)
        if v == last:
            y = loss_fn(mb, y)
            losses[mb] = y.detach()
        else:
            if tuple(y.shape) != shape:
                raise ValueError(
                    f"chunk {a.chunk} on stage {stage} returned shape {tuple(y.shape)}, but "
                    f"tensor_shape is {shape}: pass the activation shape the model produces"
                )
            (received if local(v + 1) else outgoing)[("F", mb, v)] = y.detach().contiguous()
            deallocate_output(y)  # the message holds the data until it is sent; backward needs only y's graph
        if not forward_only:
            saved[(mb, a.chunk)] = (None if v == 0 else x, y)

    def backward(a: Action) -> None:
        mb, v = a.microbatch, virtual_stage(stage, a.chunk, pp, v_shape)
        x, y = saved.pop((mb, a.chunk))  # pop: the activations are freed after this backward
        if before_last_backward is not None and last_backward[a.chunk] == mb:
            before_last_backward(a.chunk)
        with deferred_wgrads() if split else _NO_DEFERRAL as queue:
            if v == last:
                torch.autograd.backward(y)
            else:
                custom_backward(y, received.pop(("B", mb, v + 1)))
        if split:
            wgrads[(mb, a.chunk)] = queue
        if x is not None:
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            (received if local(v - 1) else outgoing)[("B", mb, v)] = grad

    def weights(a: Action) -> None:
        run_wgrads(wgrads.pop((a.microbatch, a.chunk)))

    run = {"F": forward, "B": backward, "W": weights}
    for step in plan if plan is not None else p2p_plan(actions, stage, pp, vpp, v_shape=v_shape):
        exchange(step.ops)
        for a in step.actions:
            start, cpu = time.perf_counter(), time.thread_time()
            run[a.kind](a)
            if timeline is not None:
                timeline.append((a.kind, a.microbatch, a.chunk, start, time.perf_counter(), time.thread_time() - cpu))
    assert not saved and not outgoing and not received and not wgrads, f"schedule left work behind: {sorted(saved)}"
    return [losses[mb] for mb in range(num_microbatches)] if place(last, pp, v_shape)[0] == stage else []


_NO_DEFERRAL = contextlib.nullcontext(None)
