"""Run a function on N local ranks, each a process with torch.distributed initialised.

The harness of the multi-process tests and benchmarks (jobs themselves run through the job
controller: ``service/ranks/process_launcher.py`` with ``workers/rank/process.py``). Each rank
process joins a process group on a free loopback port through
:func:`workers.rank.distributed.init_distributed` and runs ``fn(rank, world_size, *args)``.
Results come back in rank order; the first rank that raises stops the others and surfaces as
a :class:`RankFailure` naming the rank and carrying its traceback.

Processes start from a ``forkserver`` that has already imported torch, the trainer and the
parity helpers (:data:`PRELOAD`), so a rank costs a fork rather than a 3-second torch import and
a further 0.5 s of importing the trainer and the spec (pydantic) in every rank. The test session
starts that forkserver itself (:func:`start_forkserver`, from ``tests/conftest.py``) before the
first test of a process tier: a forkserver first started elsewhere in the pytest process (the
process launcher's, which preloads less) would keep its own list for the whole session.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import time
import traceback
from typing import Any, Callable, Sequence

from workers.rank.distributed import free_port, init_distributed

# What every rank of a parity test imports anyway: torch, the trainer, the parity helpers (the
# spec, pydantic, numpy) and pytest (a rank function defined in a test module imports it).
PRELOAD = ["torch", "torch.distributed", "workers.train.trainer", "tests.helpers.parity", "pytest"]
_PORT_IN_USE = "rendezvous port in use"


def start_forkserver() -> None:
    """Start this process's multiprocessing forkserver with :data:`PRELOAD` imported, unless one runs."""
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


class RankFailure(RuntimeError):
    """A rank raised (or died); carries the rank and the remote traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = ""):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed: {message}\n{remote_traceback}".rstrip())


class _Reporter:
    """Picklable ``report(payload)`` callable: sends a progress event to the parent."""

    def __init__(self, results, rank):
        self.results, self.rank = results, rank

    def __call__(self, payload) -> None:
        self.results.put((self.rank, "event", payload, ""))


def _rank_main(fn, rank, world_size, port, backend, timeout_s, args, kwargs, results, with_report):
    import torch.distributed as dist

    try:
        try:
            init_distributed(rank, world_size, "127.0.0.1", port, backend=backend, timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001
            if "address already in use" in str(exc).lower():
                # Another process took the port between free_port() and bind: retryable.
                results.put((rank, False, f"{_PORT_IN_USE}: {exc}", traceback.format_exc()))
                return
            raise
        if with_report:
            kwargs = {**kwargs, "report": _Reporter(results, rank)}
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor data into bytes; the queue's own pickler would pass
        # tensors as file descriptors that die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(out), ""))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - peers may be gone already
                pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    start_method: str = "forkserver",
    on_event: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local processes.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of ranks.
        backend: "gloo" or "nccl"; default by device.
        timeout_s: wall-clock limit for the whole run.
        collective_timeout_s: torch.distributed timeout of each collective.
        start_method: multiprocessing start method.
        on_event: if given, ``fn`` also receives ``report=`` (a callable); each
            ``report(payload)`` in a rank calls ``on_event(rank, payload)`` here.

    Returns:
        ``fn``'s return values in rank order.

    Raises:
        RankFailure: the first rank that raised or died.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        start_forkserver()
    for attempt in range(3):
        try:
            return _run_once(ctx, fn, world_size, args, kwargs, backend, timeout_s, collective_timeout_s, on_event)
        except RankFailure as failure:
            # A port clash happens before ``fn`` runs, so a retry repeats nothing.
            if _PORT_IN_USE not in str(failure) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_once(ctx, fn, world_size, args, kwargs, backend, timeout_s, collective_timeout_s, on_event) -> list[Any]:
    port = free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, port, backend, collective_timeout_s, tuple(args), kwargs or {}, results,
                  on_event is not None),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value, tb = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode not in (None, 0):
                        # Give a dying rank a moment to deliver its own report first.
                        try:
                            rank, ok, value, tb = results.get(timeout=1.0)
                        except queue.Empty:
                            raise RankFailure(r, f"process exited with code {p.exitcode}") from None
                        break
                else:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(world_size)) - set(out))
                        raise RankFailure(missing[0], f"timed out after {timeout_s:.0f}s (ranks {missing} unfinished)")
                    continue
            if ok == "event":
                on_event(rank, value)
                continue
            if not ok:
                raise RankFailure(rank, value, tb)
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        results.close()
    return [out[r] for r in range(world_size)]
