"""argparse value types that several sub-commands share (one parser, one message for each flag)."""

from __future__ import annotations

import argparse

FAULT_METAVAR = "RANK@ITER[:raise|exit|hang|save]"


def fault(text: str):
    """A ``--fault`` value, ``RANK@ITER[:KIND]`` (:meth:`workers.rank.faults.Fault.parse`)."""
    from workers.rank.faults import Fault

    try:
        return Fault.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--fault {text!r}: ")) from None


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


MAX_SIMULATED_NODES, MAX_SIMULATED_GPUS = 4096, 1024


def simulate(text: str) -> tuple[int, int]:
    """A ``--simulate NODESxGPUS`` value such as ``2x4`` (every command that takes ``--simulate``)."""
    try:
        nodes, gpus = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NODESxGPUS such as 2x4, got {text!r}") from None
    if not (1 <= nodes <= MAX_SIMULATED_NODES and 1 <= gpus <= MAX_SIMULATED_GPUS):
        raise argparse.ArgumentTypeError(f"expected NODESxGPUS with 1-{MAX_SIMULATED_NODES} nodes of "
                                         f"1-{MAX_SIMULATED_GPUS} GPUs, got {text!r}")
    return nodes, gpus
