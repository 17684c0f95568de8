"""The tiers hold: a test with no tier marker (``make test-fast``) cannot start a process, and every
test module of the suite is collected with a tier for each of its tests (tests/conftest.py)."""

from __future__ import annotations

import multiprocessing
import subprocess

import pytest

from tests.conftest import ProcessStarted


def _nothing():
    pass


def test_a_fast_test_cannot_start_a_process():
    with pytest.raises(ProcessStarted, match="carries no tier marker"):
        subprocess.run(["true"])
    with pytest.raises(ProcessStarted):
        multiprocessing.get_context("spawn").Process(target=_nothing).start()


@pytest.mark.procs
def test_a_marked_test_may():
    assert subprocess.run(["true"]).returncode == 0
