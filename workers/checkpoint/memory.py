"""In-memory checkpoints: one rank's complete state packed into one host buffer, and restored from it bit for bit.

A snapshot holds what the disk checkpointer saves of a rank (:func:`workers.checkpoint.checkpointer.local_pieces`:
the model shard and its buffers, the optimizer's moments and fp32 master; the trainer state of
:meth:`Trainer.state_for_checkpoint`: data position, successful updates, LR schedule position,
skipped steps, the fp16 loss scaler; the RNG states), but every piece the rank holds, not only
those it writes, in this rank's own layout. A snapshot therefore restores the same rank of the same
layout (a restart in place, the case of :mod:`workers.rank.replicas`); another layout is the disk
checkpoint's job.

The buffer (``torch.uint8``, on the host): ``[8 bytes: meta length][meta JSON, padded to
META_BYTES][the rank's own pieces][its shared pieces]``. Its size is a function of the layout
alone (:func:`snapshot_sizes`), so a peer can receive a replica into a buffer it allocated
beforehand. The meta carries the iteration, the rank, the layout and a fingerprint of the pieces,
checked on restore.

*Shared* pieces are those the rank's data-parallel replicas hold too, bit for bit: the params and,
without the distributed optimizer, their full moments (and fp32 masters); every rank whose shared
pieces have the same fingerprint (the same slices of the same tensors: the same tp, pp, ep, etp
coordinates) holds the same bytes there, since each applies the same reduced gradients. *Own*
pieces are the rest: the distributed optimizer's ZeRO shards and the module buffers. The meta and
the own pieces come first, so that a rank with such a twin on another node replicates only that
prefix (:mod:`workers.rank.replicas`): the shared bytes are already held off-node.
"""

from __future__ import annotations

import json
import zlib

import torch

from workers.checkpoint.checkpointer import local_pieces, rng_state, set_rng_state
from workers.checkpoint.layout import buffer_views, param_views
from workers.grid import COORDS

META_BYTES = 64 * 1024  # the meta JSON's room: RNG states and the trainer state are ~25 KB


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _fingerprint(pieces) -> int:
    described = [(p.key, p.shape, p.offsets, p.lengths, p.flat, str(d.dtype)) for p, d in pieces]
    return zlib.crc32(repr(described).encode())


def layout_key(trainer) -> dict:
    """What a snapshot must agree with to restore into ``trainer``: rank, world size, grid sizes."""
    return {"rank": trainer.rank, "world_size": trainer.grid.world_size,
            **{k: getattr(trainer.grid, k) for k in COORDS}, "vpp": trainer.vpp}


def _nbytes(pieces) -> int:
    return sum(d.numel() * d.element_size() for _, d in pieces)


def _ordered(trainer) -> tuple[list, int]:
    """``local_pieces`` in snapshot order, the own pieces first, and how many of them there are."""
    pieces = local_pieces(trainer)
    buffers = {f"model/{v.name}" for v in buffer_views(trainer)}
    own = [(p, d) for p, d in pieces if p.flat is not None or p.key in buffers]
    return own + [(p, d) for p, d in pieces if p.flat is None and p.key not in buffers], len(own)


def snapshot_sizes(trainer) -> dict:
    """``trainer``'s snapshot buffer (a function of its layout): ``nbytes`` in all, ``prefix`` (the meta
    and the own pieces: what a replica holds when the shared pieces have a twin elsewhere) and
    ``shared``, the fingerprint of the shared pieces (equal on data-parallel twins)."""
    pieces, n_own = _ordered(trainer)
    prefix = 8 + META_BYTES + _nbytes(pieces[:n_own])
    return {"nbytes": prefix + _nbytes(pieces[n_own:]), "prefix": prefix, "shared": _fingerprint(pieces[n_own:])}


class _Plan:
    """What a snapshot of one trainer copies, worked out once: its pieces' bytes (views of the live
    tensors), their fingerprint and the buffer's size. Valid while every piece's storage stays where
    it was (an optimizer that allocates its state anew gets a new plan)."""

    def __init__(self, trainer):
        pieces, _ = _ordered(trainer)
        self.sources = [_flat_bytes(d) for _, d in pieces]
        # A piece that is no view of its live tensor (a copy made contiguous) is read anew each time.
        self.where = [t.data_ptr() for t in self.sources] if all(d.is_contiguous() for _, d in pieces) else None
        self.fingerprint = _fingerprint(pieces)
        self.payload = sum(t.numel() for t in self.sources)
        self.total = 8 + META_BYTES + self.payload

    def holds(self) -> bool:
        return self.where is not None and all(t.data_ptr() == w for t, w in zip(self.sources, self.where))


def _plan(trainer) -> _Plan:
    trainer.optimizer.finish_param_gather()  # the params' all-gather from the last update, as a checkpoint needs
    plan = getattr(trainer, "_snapshot_plan", None)
    if plan is None or not plan.holds():
        plan = trainer._snapshot_plan = _Plan(trainer)
    return plan


@torch.no_grad()
def pack(trainer, out: torch.Tensor | None = None) -> torch.Tensor:
    """``trainer``'s state now, as one host buffer (``out`` is reused when it has the right size).
    Every piece is copied in one call into its place in the buffer (the pieces' list is worked out
    at the first snapshot and kept: a snapshot per iteration costs the copy, not the bookkeeping)."""
    plan = _plan(trainer)
    if out is None or out.numel() != plan.total:
        out = torch.empty(plan.total, dtype=torch.uint8)
    if plan.sources:
        torch.cat(plan.sources, out=out.narrow(0, 8 + META_BYTES, plan.payload))
    meta = json.dumps({"iteration": trainer.iteration, "layout": layout_key(trainer),
                       "fingerprint": plan.fingerprint, "nbytes": plan.total,
                       "trainer_state": trainer.state_for_checkpoint(), "rng": rng_state()}).encode()
    if len(meta) > META_BYTES:
        raise ValueError(f"snapshot meta of {len(meta)} bytes exceeds its room of {META_BYTES}")
    out[: 8 + META_BYTES].zero_()
    out[:8].copy_(torch.frombuffer(bytearray(len(meta).to_bytes(8, "little")), dtype=torch.uint8))
    out[8 : 8 + len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    return out


def read_meta(buf: torch.Tensor) -> dict:
    """The meta of a snapshot buffer (iteration, layout, fingerprint, trainer state, RNG)."""
    n = int.from_bytes(bytes(buf[:8].tolist()), "little")
    if not 0 < n <= META_BYTES:
        raise ValueError("not a snapshot buffer (its meta length is out of range)")
    return json.loads(buf[8 : 8 + n].numpy().tobytes())


@torch.no_grad()
def restore(trainer, buf: torch.Tensor) -> int:
    """Put the state of snapshot ``buf`` into ``trainer`` (the same rank of the same layout); returns
    its iteration. Param padding becomes 0, as a disk checkpoint's load leaves it."""
    meta = read_meta(buf)
    if meta["layout"] != layout_key(trainer):
        raise ValueError(f"a snapshot of {meta['layout']} cannot restore {layout_key(trainer)}")
    pieces, _ = _ordered(trainer)
    if meta["fingerprint"] != _fingerprint(pieces) or meta["nbytes"] != buf.numel():
        raise ValueError("the snapshot's pieces are not this trainer's (another model or optimizer)")
    for v in param_views(trainer):
        v.param.detach().view(-1)[v.box.numel :].zero_()
    offset = 8 + META_BYTES
    for _, data in pieces:
        n = data.numel() * data.element_size()
        data.copy_(buf[offset : offset + n].view(data.dtype).view(data.shape))
        offset += n
    trainer.load_state_from_checkpoint(meta["trainer_state"])
    set_rng_state(meta["rng"])
    return int(meta["iteration"])


__all__ = ["META_BYTES", "layout_key", "pack", "read_meta", "restore", "snapshot_sizes"]
