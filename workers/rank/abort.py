"""Ending a rank's train step from another thread when a peer is known dead, instead of computing on to its next collective with the dead peer.

When one rank of an attempt dies, the others fail only once each reaches a collective with a
failed peer: a rank whose groups hold no dead rank computes on for the rest of its forward and
backward (0.1-0.3 s of an iteration of the recovery benchmark on two cores) before its
data-parallel reduction fails, and the restart waits for the slowest of them. The Ray launcher
asks every rank whose call is still running to abort as soon as it knows of a death
(``RankActor.abort``, answered on the actor's second thread); :class:`StepAbort` raises
:class:`StepAborted` in the thread running the step, at its next Python bytecode (torch returns
to Python between operators), and only inside :meth:`StepAbort.window`, which the rank opens
around the train step alone: a checkpoint save or an in-memory snapshot is never cut in two. An
abort that comes outside the window ends the next one at its start. The step's failure is then
handled like any other (the rank leaves its groups, so the peers blocked in a collective with
it fail at once). An exception raised at any bytecode may land inside a context manager's
``__enter__`` and skip its ``__exit__``: the window puts the thread's grad mode back as the step
found it (the training code's only thread-local state entered that way: ``no_grad``; no autocast).
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager


class StepAborted(RuntimeError):
    """The train step was ended from outside: a peer of this attempt died."""


def _raise_in(thread_id: int, exc_type) -> None:
    """Raise ``exc_type`` in thread ``thread_id`` at its next bytecode (None: drop one pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type is not None else None)


class StepAbort:
    """One attempt's abort switch (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: int | None = None  # the thread inside the window
        self.requested = False

    @contextmanager
    def window(self):
        """The span in which an abort raises :class:`StepAborted` at once (the train step)."""
        import torch

        me, grad = threading.get_ident(), torch.is_grad_enabled()
        with self._lock:
            if self.requested:
                raise StepAborted("a peer of this attempt died (aborted before the step)")
            self._thread = me
        try:
            yield
        finally:
            # An abort raised inside a context manager's __enter__ skips its __exit__: the thread's
            # grad mode (a no_grad half entered) is put back, as the step found it.
            torch.set_grad_enabled(grad)
            with self._lock:
                self._thread, late = None, self.requested
                if late:
                    _raise_in(me, None)  # one pending and not raised yet: dropped (raised below)
        if late:  # an abort came in the window and the step ended anyway (too late, or swallowed)
            raise StepAborted("a peer of this attempt died (aborted in the train step)")

    def abort(self) -> bool:
        """Ask for the abort; True when the step was running and is being ended."""
        with self._lock:
            self.requested = True
            if self._thread is None:
                return False
            _raise_in(self._thread, StepAborted)
            return True


__all__ = ["StepAbort", "StepAborted"]
