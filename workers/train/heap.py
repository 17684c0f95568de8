"""The C heap of a rank process (glibc): freed tensors' memory goes back to the OS.

torch's CPU allocator is plain ``malloc``/``free``. The trainer (:class:`workers.train.trainer.Trainer`)
trims the heap once built (:func:`release_free_heap`) and, when ``RAYTRON_MMAP_THRESHOLD`` is
set, pins glibc's mmap threshold to it before it builds anything (:func:`pin_mmap_threshold`);
both do nothing without glibc. :func:`peak_memory_mb` is what an iteration reports as its peak.

The pin is opt-in because it trades time for memory on CPU: with every block of 128 KiB or more
mmapped, each step maps, zero-fills and unmaps its activations. Measured in one process (L4 h256
s256 gbs 8, 1 thread, two runs each): 0.90 / 0.89 s per step pinned at 128 KiB, 0.70 / 0.77 at
1 MiB, 0.64 / 0.68 s unpinned. ``bench/auto_layout_bench.py --memory`` sets it (128 KiB) to
measure what the tensors need rather than the heap's slack.
"""

from __future__ import annotations

import functools
import os

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
ENV = "RAYTRON_MMAP_THRESHOLD"
"""Bytes from which glibc serves a block by ``mmap``, pinned (unset: glibc's own dynamic threshold)."""


@functools.cache
def _libc():
    """glibc, loaded once; None elsewhere. The process's own C library is already mapped, so it is
    opened by name (``ctypes.util.find_library`` would run ``ldconfig -p`` in a child process)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def pin_mmap_threshold() -> None:
    """With ``RAYTRON_MMAP_THRESHOLD`` set: keep glibc serving every block of that many bytes or
    more by ``mmap``, so a freed tensor's memory goes back to the OS at once (unset, or elsewhere
    than glibc: nothing).

    glibc raises its threshold to the size of each mmapped block freed (up to 32 MiB), after
    which activations, gradients of activations and the initializer's draws come from the heap,
    whose free pages stay resident and fragment: measured on CPU (``bench/auto_layout_bench.py
    --memory``), the training peak sat ~0.6 x the saved activations above what the tensors
    needed. Setting the threshold explicitly turns the dynamic rise off."""
    threshold = os.environ.get(ENV)
    libc = _libc() if threshold else None
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, int(threshold))


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing):
    what building the shard freed below the mmap threshold (small params' first storage, which
    the optimizer copies into its flat buffers)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_memory_mb(device) -> float:
    """This process's peak memory so far in MiB: the CUDA allocator's peak on a GPU, else the
    process's peak resident set (``ru_maxrss``)."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
