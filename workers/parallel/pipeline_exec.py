"""Run a pipeline schedule table (see :mod:`workers.parallel.pipeline`) with real tensors.

One call runs one iteration's forwards and backwards on one stage. Activations and their
gradients travel between neighbouring stages with point-to-point messages through
:func:`workers.parallel.comm.p2p`:

* a forward receives the activation of the previous virtual stage, runs the chunk and sends
  its output to the next virtual stage;
* a backward receives the output gradient from the next virtual stage (on the last virtual
  stage it backpropagates the loss instead) and sends the input gradient back.

Every message carries a tag made of (direction, sending virtual stage, microbatch), so a
receiver matches messages by meaning, never by arrival order: with interleaving, two
neighbours exchange several chunks' activations and gradients over one pair of ranks. Sends
are posted asynchronously and waited at the end, so a stage that has sent never waits for its
neighbour to receive; receives block. That is exactly the model
:func:`workers.parallel.pipeline.simulate` proves deadlock-free.

Tags are honoured by gloo (the CPU backend). NCCL ignores them and matches a pair's messages in
posting order; Megatron's tables keep that order (see
:func:`workers.parallel.pipeline.check_message_order`), but NCCL also serialises a pair's
operations on one stream, so a GPU run should batch each step's send and receive together as
Megatron does. Only gloo is tested here.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from workers.parallel import comm
from workers.parallel.pipeline import Action

_FWD, _BWD = 0, 1


def _tag(direction: int, virtual_stage: int, microbatch: int, num_virtual: int) -> int:
    """A message's tag: unique per (direction, sender's virtual stage, microbatch)."""
    return (microbatch * num_virtual + virtual_stage) * 2 + direction


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
    before_last_backward: Callable[[], None] | None = None,
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
        before_last_backward: called just before this stage's final backward, so that the
            data-parallel reduction can overlap with it (every gradient is final after it).

    Returns:
        On the last stage, the detached loss of each microbatch in microbatch order; elsewhere
        an empty list.

    Raises:
        ValueError: sizes that do not agree, or a chunk output not of ``tensor_shape``.
    """
    if len(pp_ranks) != pp or len(chunks) != vpp or not 0 <= stage < pp:
        raise ValueError(
            f"run_pipeline: stage {stage}, pp {pp}, vpp {vpp} need len(pp_ranks) == pp (got "
            f"{len(pp_ranks)}) and len(chunks) == vpp (got {len(chunks)})"
        )
    shape = tuple(tensor_shape)
    num_virtual = pp * vpp
    last = num_virtual - 1
    prev_rank = pp_ranks[(stage - 1) % pp]
    next_rank = pp_ranks[(stage + 1) % pp]

    def recv(peer: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        for work in comm.p2p([], [(buf, peer, tag)], group):
            work.wait()
        return buf

    sends: list = []  # (work, tensor): the tensor must stay alive until its send completes

    def send(tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        sends.extend((w, tensor) for w in comm.p2p([(tensor, peer, tag)], [], group))
        # Drop finished sends so long schedules keep only the 1F1B working set alive.
        sends[:] = [(w, t) for w, t in sends if not w.is_completed()]

    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    losses: dict[int, torch.Tensor] = {}
    last_backward = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
    for i, a in enumerate(actions):
        mb, v = a.microbatch, a.chunk * pp + stage
        if a.kind == "F":
            if v == 0:
                x = get_input(mb)
            else:
                x = recv(prev_rank, _tag(_FWD, v - 1, mb, num_virtual)).requires_grad_()
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
                send(y, next_rank, _tag(_FWD, v, mb, num_virtual))
            saved[(mb, a.chunk)] = (None if v == 0 else x, y)
        else:
            # pop: the activations are freed as soon as this backward is done
            x, y = saved.pop((mb, a.chunk))
            if i == last_backward and before_last_backward is not None:
                before_last_backward()
            if v == last:
                torch.autograd.backward(y)
            else:
                grad = recv(next_rank, _tag(_BWD, v + 1, mb, num_virtual))
                torch.autograd.backward(y, grad_tensors=grad)
            if x is not None:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                send(gx, prev_rank, _tag(_BWD, v, mb, num_virtual))
    for work, _ in sends:
        work.wait()
    assert not saved, f"schedule left forwards without backwards: {sorted(saved)}"
    return [losses[mb] for mb in range(num_microbatches)] if stage == pp - 1 else []
