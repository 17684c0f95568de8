"""Failure drills: make one rank fail on purpose (``raytron run|serve --fault RANK@ITER[:KIND]``).

A :class:`Fault` fires just before iteration ``iteration`` (1-based) on rank ``rank``:

* ``raise``: the rank raises :class:`InjectedFault` (a bug in user code, a bad batch);
* ``exit``: the process dies at once with no cleanup (a segfault, the OOM killer);
* ``hang``: the rank stops answering inside its next collective, so that only the collective
  timeout of its peers (and the controller's progress watch) can catch it;
* ``save``: the process dies in the middle of writing the checkpoint saved after iteration
  ``iteration`` (its data file written, its record not), so that checkpoint is never committed.

The hang patches this process's ``torch.distributed`` entry points: the next collective or
point-to-point call reports the group kind it was called on (through ``on_stall``) and then
blocks forever. Nothing is patched unless a hang drill fires.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

KINDS = ("raise", "exit", "hang", "save")

# torch.distributed calls that communicate; a hung rank blocks in the first one it reaches. (Not
# isend/irecv: P2POp checks their identity; pipelines reach them through batch_isend_irecv.)
_BLOCKING = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "all_to_all", "all_to_all_single", "broadcast", "barrier", "send", "recv",
             "batch_isend_irecv")


class InjectedFault(RuntimeError):
    """Raised by a rank on purpose (a ``raise`` drill)."""


@dataclass(frozen=True)
class Fault:
    """A failure to provoke on ``rank`` just before iteration ``iteration`` (1-based)."""

    rank: int
    iteration: int
    kind: str = "raise"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.rank < 0:
            raise ValueError(f"fault rank must be >= 0, got {self.rank}")
        if self.iteration < 1:
            raise ValueError(f"fault iteration is 1-based, got {self.iteration}")

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """``RANK@ITER[:KIND]``, e.g. ``1@3:exit``; KIND defaults to ``raise``."""
        where, _, kind = text.partition(":")
        rank, at, iteration = where.partition("@")
        try:
            if not at:
                raise ValueError
            return cls(int(rank), int(iteration), kind or "raise")
        except ValueError as e:
            detail = str(e) if str(e) else "expected RANK@ITER[:raise|exit|hang|save], e.g. 1@3:exit"
            raise ValueError(f"--fault {text!r}: {detail}") from None

    def __str__(self) -> str:
        """The ``RANK@ITER:KIND`` form :meth:`parse` reads back (how a drill travels on a command line)."""
        return f"{self.rank}@{self.iteration}:{self.kind}"

    def within(self, world_size: int) -> bool:
        """Whether a job of ``world_size`` ranks has this drill's rank."""
        return self.rank < world_size


def check_ranks(faults, world_size: int) -> None:
    """Refuse (ValueError) the first drill whose rank a job of ``world_size`` ranks does not have."""
    for f in faults:
        if not f.within(world_size):
            raise ValueError(f"--fault {f.rank}@{f.iteration}: rank {f.rank} is outside the job's "
                             f"{world_size} ranks (0..{world_size - 1})")


def trigger(fault: Fault, on_stall: Callable[[str], None] | None = None) -> None:
    """Carry out ``fault`` in this rank (see the module docstring)."""
    if fault.kind == "exit":
        os._exit(1)  # no cleanup, no exception: what a segfault or the OOM killer looks like
    if fault.kind == "raise":
        raise InjectedFault(f"rank {fault.rank}: injected fault before iteration {fault.iteration}")
    _arm_hang(on_stall)


def crash_in_save(checkpointer) -> None:
    """Make this process die right after it writes its next checkpoint data file (a ``save`` drill)."""
    storage = checkpointer.root
    write = storage.write

    def write_then_die(path, chunks):
        out = write(path, chunks)
        if path.endswith(".bin"):
            os._exit(1)
        return out

    object.__setattr__(storage, "write", write_then_die)  # Storage is a frozen dataclass


def _group_kind(group) -> str:
    from workers.parallel import comm

    return "world" if group is None else comm.group_label(group)


def _arm_hang(on_stall: Callable[[str], None] | None) -> None:
    import torch.distributed as dist

    def blocker(name):
        def blocked(*args, **kwargs):
            group = kwargs.get("group")
            if name == "batch_isend_irecv" and args:
                group = getattr(args[0][0], "group", None) if args[0] else None
            elif group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if on_stall is not None:
                on_stall(f"{_group_kind(group)} {name}")
            threading.Event().wait()  # never set: the rank stops answering
        return blocked

    for name in _BLOCKING:
        if hasattr(dist, name):
            setattr(dist, name, blocker(name))
