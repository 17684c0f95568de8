"""argparse value types that several sub-commands share (one parser, one message for each flag)."""

from __future__ import annotations

import argparse

FAULT_METAVAR = "RANK@ITER[:raise|exit|hang|save]"


def fault(text: str):
    """A ``--fault`` value, ``RANK@ITER[:KIND]`` (:meth:`workers.faults.Fault.parse`)."""
    from workers.faults import Fault

    try:
        return Fault.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--fault {text!r}: ")) from None
