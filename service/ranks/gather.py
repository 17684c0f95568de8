"""Collecting every rank's answer to one call, and naming the rank that broke it.

Both launchers use :func:`collect`; only how an answer arrives differs (``ray.wait`` on
object refs, ``multiprocessing.connection.wait`` on pipes). The rules:

* The first failure opens a short grace period: a rank's death or exception reaches its
  peers ("connection closed by peer", "timed out") about as fast as it reaches the launcher,
  so the root cause gets a moment to arrive before a rank is named.
* A root cause (a death, or an exception that is not a peer symptom) wins over symptoms.
* When only symptoms arrived and some ranks never answered, the silent rank is the one that
  broke the collective: a hang (a rank stopped with SIGSTOP, a deadlock, a hang drill).
* Progress watch: when some ranks finished and another has not answered ``stall_s`` after
  them, it is named as stalled, even if no collective timed out.
"""

from __future__ import annotations

import re
import time
from typing import Callable

from service.control.errors import JobError, RankDied, RankError, RankHung, is_root_cause

Poll = Callable[[set[int], float | None], list[tuple[int, object]]]


def collect(ranks: list[int], poll: Poll, *, where: Callable[[int], dict], grace_s: float,
            stall_s: float | None = None, timeout_s: float | None = None,
            stall_hint: Callable[[int], str] | None = None, what: str = "answer") -> dict[int, object]:
    """Wait for every rank's answer; returns ``{rank: value}`` or raises the root cause.

    Args:
        ranks: the ranks that were asked.
        poll: ``poll(pending, timeout_s)`` returns the ``(rank, value)`` pairs that arrived
            within ``timeout_s`` (None: wait for at least one); a value that is a
            :class:`RankError` is that rank's failure.
        where: rank -> its node, node id, pid and coordinates, for a :class:`RankHung`.
        grace_s: how long to wait after the first failure for the root cause.
        stall_s: progress watch (see the module docstring); None: off.
        timeout_s: overall limit (start-up); None: none.
        stall_hint: rank -> what it is blocked in ("tp all_reduce"), or "".
        what: what was asked, for messages ("run", "start").

    Raises:
        RankError: the rank named by the rules above.
        JobError: nothing failed but ranks did not answer within ``timeout_s``.
    """
    pending, results, failures = set(ranks), {}, []
    start = time.monotonic()
    first_failure = first_done = None
    while pending:
        now = time.monotonic()
        limits = [start + timeout_s] if timeout_s is not None else []
        if failures:
            if any(is_root_cause(f) for f in failures):
                break
            limits.append(first_failure + grace_s)
        elif first_done is not None and stall_s is not None:
            limits.append(first_done + stall_s)
        until = min(limits) if limits else None
        if until is not None and now >= until:
            break
        for rank, value in poll(pending, None if until is None else until - now):
            pending.discard(rank)
            if isinstance(value, RankError):
                failures.append(value)
                first_failure = first_failure or time.monotonic()
            else:
                results[rank] = value
                first_done = first_done or time.monotonic()
    if failures:
        roots = [f for f in failures if is_root_cause(f)]
        if roots:
            raise min(roots, key=lambda e: (not isinstance(e, RankDied), failures.index(e)))
        if pending:
            raise _hung(pending, where, stall_hint, f"its peers gave up on it ({peer_summary(failures[0].cause)})")
        raise failures[0]
    if pending:
        if results and stall_s is not None:
            raise _hung(pending, where, stall_hint, f"no answer to {what} {stall_s:.0f}s after its peers'")
        raise JobError(f"ranks {sorted(pending)} did not {what} within {timeout_s:.0f}s")
    return results


def _hung(pending: set[int], where, stall_hint, why: str) -> RankHung:
    hints = {r: (stall_hint(r) if stall_hint else "") for r in sorted(pending)}
    rank = next((r for r, h in hints.items() if h), min(pending))  # a hang drill names its own collective
    others = sorted(pending - {rank})
    place = where(rank)
    detail = ""
    if hints[rank]:  # "pp batch_isend_irecv": the group kind, then the call
        group, _, call = hints[rank].partition(" ")
        place["group"] = group
        detail = f"blocked in {call} on its {group} group; "
    also = f"; ranks {others} also silent" if others else ""
    return RankHung(rank, place, f"{detail}{why}{also}")


def peer_summary(cause: str) -> str:
    """A peer's error without gloo's source locations ("[.../pair.cc:534] ")."""
    return re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", cause)
