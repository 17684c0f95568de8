"""``--launcher processes``: a job's ranks as local processes, driven by the job controller.

:class:`ProcessRankGroup` is one attempt: one process per rank (``workers/rank/process.py``),
each with a duplex command pipe, forked from a ``forkserver`` that has already imported torch
(a rank costs a fork, not a 3-second import). Rendezvous is a free loopback port; a port taken
between choosing and binding it is retried with a new one. Failures are typed exactly as on
Ray: a process that exits is :class:`~service.control.errors.RankDied` (with its exit code), an
exception is :class:`~service.control.errors.RankRaised`, and a rank that stops answering while its
peers give up is :class:`~service.control.errors.RankHung` (:mod:`service.ranks.gather`).

With in-memory checkpoints (``fault_tolerance.memory_interval``) a restart keeps the rank processes
that survived the failed attempt, as the Ray launcher keeps its actors: at ``shutdown(keep_warm=True)``
every rank whose call ended is told to ``reset`` (leave its process groups, free its trainer, keep its
snapshots and the replicas it holds), those that answer within ``LauncherConfig.reuse_wait_s`` wait in
the launcher (:class:`WarmProcesses`), and the next attempt of the same shape starts new processes only
for the others; every rank then restores the newest iteration held in memory
(:class:`workers.rank.replicas.Replicator`), the replicas placed on another node of the plan
(:func:`~service.spec.placement.plan_placement`'s simulated nodes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as wait_any
from typing import Callable

from service.control.rank_group import LauncherConfig
from service.control.errors import JobError, RankDied, RankRaised
from service.control.recovery import KeptRanks
from service.ranks.gather import collect
from service.spec.placement import RankPlacement, plan_placement
from workers.config import JobConfig
from workers.rank.faults import Fault
from workers.grid import COORDS, ParallelGrid
from workers.rank.placement_record import PlacementRecord

_PRELOAD = ["torch", "torch.distributed", "workers.train.trainer"]
_PORT_RETRIES = 3


class _PortInUse(Exception):
    pass


@dataclass
class WarmProcesses:
    """The rank processes that survived a failed attempt, reset, holding their in-memory state:
    what the next attempt of the same shape (``key``) starts on instead of new processes."""

    key: tuple
    ranks: dict  # rank -> (process, pipe)

    def release(self) -> None:
        """Stop the processes."""
        ranks, self.ranks = self.ranks, {}
        _stop([p for p, _ in ranks.values()], [c for _, c in ranks.values()])


class ProcessRankGroup:
    """The rank processes of one attempt (see the module docstring)."""

    def __init__(self, job: JobConfig, grid: ParallelGrid, plan: list[RankPlacement], *,
                 config: LauncherConfig, start_method: str = "forkserver", warm: WarmProcesses | None = None,
                 park: Callable[[WarmProcesses], None] | None = None):
        self.job, self.grid, self.plan, self.config = job, grid, plan, config
        self.key = (grid.world_size, job.num_nodes, job.gpus_per_node, tuple(plan))
        self.warm, self._park = warm, park  # ranks kept from the last attempt; takes this one's survivors
        self.reused: list[int] = []
        self._ran = False  # run() was called: every rank's last call is a run
        self.ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self.ctx.set_forkserver_preload(_PRELOAD)
        self.procs: list = []
        self.conns: list = []
        self.placement: list[PlacementRecord] = []
        self.stalls: dict[int, str] = {}
        self.sigterms: dict[int, float | None] = {}  # rank -> deadline, from its SIGTERM notice

    def start(self, faults: list[Fault]) -> list[dict]:
        for attempt in range(_PORT_RETRIES):
            try:
                return self._start_once(tuple(faults))
            except _PortInUse:  # another process took the port before rank 0 bound it
                self.shutdown()
                if attempt == _PORT_RETRIES - 1:
                    raise JobError(f"no free rendezvous port after {_PORT_RETRIES} tries") from None
        raise AssertionError("unreachable")

    def _start_once(self, faults: tuple) -> list[dict]:
        from workers.rank.process import rank_process_main
        from workers.rank.distributed import free_port

        port = free_port()
        warm, self.warm = self.warm, None
        kept = warm.ranks if warm is not None and warm.key == self.key else {}
        if warm is not None and not kept:
            warm.release()  # another shape (a resize)
        self.reused = sorted(kept)
        for p in self.plan:
            args = (self.grid.world_size, self.job, "127.0.0.1", port, p.local, float(self.job.collective_timeout_s),
                    faults, p.node)
            if p.rank in kept:
                proc, parent = kept[p.rank]
                parent.send(("setup", args))
            else:
                parent, child = self.ctx.Pipe()
                proc = self.ctx.Process(target=rank_process_main, name=f"raytron-rank{p.rank}", daemon=True,
                                        args=(child, p.rank, *args))
                proc.start()
                child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        records = collect(list(range(len(self.procs))), self._poll("ready"), where=self._where,
                          grace_s=self.config.failure_grace_s, timeout_s=self.config.start_timeout_s, what="start")
        self.placement = [replace(records[r], node=self.plan[r].node, reused=True if r in kept else None)
                          for r in range(len(self.procs))]
        return [record.to_dict() for record in self.placement]

    def run(self, iterations: int) -> list[list[dict]]:
        self._ran = True
        for conn in self.conns:
            try:
                conn.send(("run", iterations))
            except OSError:  # a dead rank: collect() reports it
                pass
        out = collect(list(range(len(self.conns))), self._poll("metrics"), where=self._where,
                      grace_s=self.config.failure_grace_s, stall_s=self.job.collective_timeout_s,
                      stall_hint=lambda r: self.stalls.get(r, ""), what="run")
        return [out[r] for r in range(len(self.conns))]

    def save_now(self) -> list[dict]:
        """Every rank saves a checkpoint of the current iteration, committed when this returns (a preemption)."""
        for conn in self.conns:
            conn.send(("save_now",))
        out = collect(list(range(len(self.conns))), self._poll("saved"), where=self._where,
                      grace_s=self.config.failure_grace_s, timeout_s=self.config.start_timeout_s, what="save")
        return [out[r] for r in range(len(self.conns))]

    def notices(self) -> dict[int, float | None]:
        """Rank -> deadline of the ranks that got a SIGTERM (a preemption notice), as reported so far."""
        return dict(self.sigterms)

    def kill(self) -> None:
        _kill(list(self.procs))

    def shutdown(self, keep_warm: bool = False) -> None:
        """Stops every rank process; with ``keep_warm`` and in-memory checkpoints, all but the
        survivors, which the launcher keeps for the next attempt (the module docstring)."""
        kept = self._survivors() if keep_warm and self._park is not None and self.job.memory_interval and self._ran else {}
        if self.warm is not None:  # start() never ran
            self.warm.release()
            self.warm = None
        if kept:
            self.procs = [p for r, p in enumerate(self.procs) if r not in kept]
            self.conns = [c for r, c in enumerate(self.conns) if r not in kept]
            self._park(WarmProcesses(self.key, kept))
        procs, conns, self.procs, self.conns = self.procs, self.conns, [], []
        _stop(procs, conns)

    def _survivors(self) -> dict:
        """rank -> (process, pipe) of the ranks that answer ``reset`` within ``reuse_wait_s``
        (their call ended: returned, or raised and the process lives); the others are stopped."""
        pending = set()
        for r, conn in enumerate(self.conns):
            try:
                conn.send(("reset",))
                pending.add(r)
            except (OSError, ValueError):  # dead
                pass
        deadline, kept = time.monotonic() + self.config.reuse_wait_s, {}
        poll = self._poll("reset")
        while pending and (left := deadline - time.monotonic()) > 0:
            for r, answer in poll(pending, left):
                pending.discard(r)
                if not isinstance(answer, Exception):
                    kept[r] = (self.procs[r], self.conns[r])
        return kept

    def _poll(self, expected: str):
        """A ``poll(pending, timeout)`` for :func:`service.ranks.gather.collect` over pipes and process sentinels."""
        def poll(pending: set[int], timeout: float | None) -> list[tuple[int, object]]:
            handles = {}
            for r in pending:
                handles[self.conns[r]] = r
                handles[self.procs[r].sentinel] = r
            ready = {handles[h] for h in wait_any(list(handles), timeout)}
            answers = ((r, self._read(r, expected)) for r in sorted(ready))
            return [(r, value) for r, value in answers if value is not None]

        return poll

    def _read(self, rank: int, expected: str):
        """The rank's answer (a value or a RankError), or None if it has not answered yet."""
        conn, eof = self.conns[rank], False
        while True:
            try:
                if not conn.poll():
                    break
                msg = conn.recv()
            except (EOFError, OSError):
                eof = True
                break
            if msg[0] == "stall":
                self.stalls[rank] = msg[1]
            elif msg[0] == "notice":
                self.sigterms[rank] = msg[1]["deadline"]
            elif msg[0] == expected:
                return msg[1]
            elif msg[0] == "port_in_use":
                raise _PortInUse(msg[1])
            elif msg[0] == "error" and expected != "reset":  # an error before the reset: the failed call's
                return RankRaised(rank, self._where(rank), msg[1], msg[2])
        proc = self.procs[rank]
        if proc.exitcode is None and eof:
            proc.join(timeout=1.0)  # the pipe closed: the process is on its way out
        if proc.exitcode is None:
            return None
        return RankDied(rank, self._where(rank), _exit_cause(proc.exitcode))

    def _where(self, rank: int) -> dict:
        """Node, host, pid and coordinates of a rank, for its failure (before the rank reported
        its record: the plan's node, the process's pid and the grid's coordinates)."""
        if rank < len(self.placement):
            return self.placement[rank].where()
        c = self.grid.coords(rank)
        pid = self.procs[rank].pid if rank < len(self.procs) else None
        return {"node": self.plan[rank].node, "pid": pid, **{k: c[k] for k in COORDS}}


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.pid is not None:
            try:
                os.kill(proc.pid, signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
            except OSError:
                pass


def _stop(procs: list, conns: list) -> None:
    """Ask the rank processes to exit, kill those that do not within a grace, close their pipes."""
    for conn in conns:
        try:
            conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0  # one grace for all: a rank stuck in a collective never reads the pipe
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    _kill(procs)
    for proc in procs:
        proc.join(timeout=5)
    for conn in conns:
        conn.close()


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            return f"process killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"process killed by signal {-code}"
    return f"process exited with code {code}"


class ProcessLauncher:
    """Builds a :class:`ProcessRankGroup` per attempt (``start_job(launcher=...)``)."""

    name = "processes"
    saves_on_notice = True  # a rank's SIGTERM saves a checkpoint: jobs get a checkpoint.dir

    def __init__(self, config: LauncherConfig | None = None):
        self.config = config or LauncherConfig()
        self.kept = KeptRanks()  # job id -> rank processes kept for its next attempt

    def make_group(self, job: JobConfig, grid: ParallelGrid, attempt: int, *, job_id: str) -> ProcessRankGroup:
        plan = plan_placement(grid, job.gpus_per_node, job.num_nodes)
        return ProcessRankGroup(job, grid, plan, config=self.config, warm=self.kept.take(job_id),
                                park=lambda warm: self.kept.park(job_id, warm))

    def release(self, job_id: str) -> None:
        """The job is over: stop the rank processes kept for its next attempt."""
        self.kept.release(job_id)
