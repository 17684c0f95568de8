"""A rank's packed microbatches (:mod:`workers.data.packing`) in training: the CP split, the
documents each model chunk's forward needs, and the loss-token count of the global batch.

The loss of a packed iteration is Megatron's ``calculate_per_token_loss``: every microbatch
contributes ``sum(loss_mask * token loss) / N`` with ``N`` the loss tokens of the whole global
batch, counted on each rank over its microbatches and summed over dp-cp before the schedule
runs. The gradients summed over ranks are then those of the global mean over loss tokens,
whatever the data-parallel, context-parallel or microbatch split.

A model chunk's forward needs its microbatch's position ids and documents on every pipeline
stage, not only where the tokens enter; the pipeline executor calls a chunk with the activation
alone, so each chunk is wrapped in a callable that takes the microbatches in the order the
stage's schedule runs its forwards.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from workers.data.packing import PackedBatch
from workers.parallel import comm
from workers.parallel.context import document_cp_split


class LocalBatch(NamedTuple):
    """This rank's part of a packed microbatch, sequence-first ``[s_local, b]`` (CP-split)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    docs: tuple
    """Each row's ``cu_seqlens`` over the whole sequence (the CP attention plans read them)."""


def local_batch(batch: PackedBatch, cp: int, cp_rank: int, to_device) -> LocalBatch:
    """``batch`` transposed to ``[s, b]``, split over CP (each document's load-balanced chunks, as
    Megatron's THD split) and moved."""

    def local(x: torch.Tensor) -> torch.Tensor:
        x = x.t()
        return to_device(document_cp_split(x, cp, cp_rank, batch.cu_seqlens) if cp > 1 else x)

    return LocalBatch(local(batch.tokens), local(batch.labels), local(batch.loss_mask),
                      local(batch.position_ids), batch.cu_seqlens)


class PackedMicrobatches:
    """The iteration's microbatches of this rank, read once each (``read(mb) -> LocalBatch``)."""

    def __init__(self, read, num_microbatches: int):
        self.read, self.num_microbatches = read, num_microbatches
        self._batches: dict[int, LocalBatch] = {}

    def get(self, mb: int) -> LocalBatch:
        if mb not in self._batches:
            self._batches[mb] = self.read(mb)
        return self._batches[mb]

    def loss_tokens(self, group) -> torch.Tensor:
        """The global batch's loss tokens: this rank's microbatches summed over ``group`` (dp-cp)."""
        count = sum(self.get(mb).loss_mask.sum(dtype=torch.float32) for mb in range(self.num_microbatches))
        count = count.reshape(1)
        comm.all_reduce(count, group)
        return count.reshape(()).clamp_(min=1.0)  # a batch without loss tokens has zero loss, not nan

    def chunk_callables(self, chunks, actions) -> list:
        """``chunks`` as the executor calls them, each passed its microbatch's packing."""
        calls = []
        for c, chunk in enumerate(chunks):
            order = iter([a.microbatch for a in actions if a.kind == "F" and a.chunk == c])

            def forward(x, chunk=chunk, order=order):
                batch = self.get(next(order))
                return chunk(x, packing=(batch.position_ids, batch.docs))

            calls.append(forward)
        return calls


def packed_iteration(read, num_microbatches: int, chunks, actions, group, *, last_stage: bool):
    """What a packed iteration runs on: ``(microbatch getter, chunk callables, loss denominator)``;
    the denominator (the global batch's loss tokens, a collective over ``group``) on the last stage only."""
    batches = PackedMicrobatches(read, num_microbatches)
    return (batches.get, batches.chunk_callables(chunks, actions),
            batches.loss_tokens(group) if last_stage else 1)


def sampler_of(t, seq_length: int):
    """``(packed, sampler)`` of a training config: chat rows (``chat_data``), packed pretraining
    windows (the document switches or ``calculate_per_token_loss``), or plain windows."""
    from workers.data.dataset import GlobalSampler
    from workers.data.packing import DocumentRules

    if t.chat_data:
        from workers.data.chat_sampler import ChatSampler

        return True, ChatSampler(t, seq_length)
    rules = DocumentRules.of(t)
    packed = rules.packed or t.calculate_per_token_loss
    return packed, GlobalSampler(t.data, seq_length, t.seed, t.global_batch_size, split=t.split,
                                 rules=rules if packed else None)
