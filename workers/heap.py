"""The C heap of a rank process (glibc): freed tensors' memory goes back to the OS.

torch's CPU allocator is plain ``malloc``/``free``. The trainer (:class:`workers.train.Trainer`)
pins glibc's mmap threshold before it builds anything (:func:`pin_mmap_threshold`) and trims
the heap once built (:func:`release_free_heap`); both do nothing without glibc.
"""

from __future__ import annotations

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 1024
"""Bytes from which glibc serves a block by ``mmap`` (its initial default, pinned)."""


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def pin_mmap_threshold() -> None:
    """Keep glibc serving every block of :data:`MMAP_THRESHOLD` bytes or more by ``mmap``, so a
    freed tensor's memory goes back to the OS at once (elsewhere than glibc: nothing).

    glibc raises its threshold to the size of each mmapped block freed (up to 32 MiB), after
    which activations, gradients of activations and the initializer's draws come from the heap,
    whose free pages stay resident and fragment: measured on CPU (``bench/auto_layout_bench.py
    --memory``), the training peak sat ~0.6 x the saved activations above what the tensors
    needed. Setting the threshold explicitly turns the dynamic rise off."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing):
    what building the shard freed below the mmap threshold (small params' first storage, which
    the optimizer copies into its flat buffers)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
