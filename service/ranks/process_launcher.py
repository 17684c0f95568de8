"""``--launcher processes``: a job's ranks as local processes, driven by the job controller.

:class:`ProcessRankGroup` is one attempt: one process per rank (``workers/rank/process.py``),
each with a duplex command pipe, forked from a ``forkserver`` that has already imported torch
(a rank costs a fork, not a 3-second import). Rendezvous is a free loopback port; a port taken
between choosing and binding it is retried with a new one. Failures are typed exactly as on
Ray: a process that exits is :class:`~service.control.errors.RankDied` (with its exit code), an
exception is :class:`~service.control.errors.RankRaised`, and a rank that stops answering while its
peers give up is :class:`~service.control.errors.RankHung` (:mod:`service.ranks.gather`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace
from multiprocessing.connection import wait as wait_any

from service.control.rank_group import LauncherConfig
from service.control.errors import JobError, RankDied, RankRaised
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


class ProcessRankGroup:
    """The rank processes of one attempt (see the module docstring)."""

    def __init__(self, job: JobConfig, grid: ParallelGrid, plan: list[RankPlacement], *,
                 config: LauncherConfig, start_method: str = "forkserver"):
        self.job, self.grid, self.plan, self.config = job, grid, plan, config
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
        for p in self.plan:
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=rank_process_main, name=f"raytron-rank{p.rank}", daemon=True,
                args=(child, p.rank, self.grid.world_size, self.job, "127.0.0.1", port, p.local,
                      float(self.job.collective_timeout_s), faults))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        records = collect(list(range(len(self.procs))), self._poll("ready"), where=self._where,
                          grace_s=self.config.failure_grace_s, timeout_s=self.config.start_timeout_s, what="start")
        self.placement = [replace(records[r], node=self.plan[r].node) for r in range(len(self.procs))]
        return [record.to_dict() for record in self.placement]

    def run(self, iterations: int) -> list[list[dict]]:
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
        for proc in list(self.procs):
            if proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)  # works on a stopped (SIGSTOP) process too
                except OSError:
                    pass

    def shutdown(self, keep_warm: bool = False) -> None:
        """Stops every rank process (``keep_warm`` is not used: each attempt starts new processes)."""
        for conn in self.conns:
            try:
                conn.send(("shutdown",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0  # one grace for all: a rank stuck in a collective never reads the pipe
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

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
            elif msg[0] == "error":
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

    def make_group(self, job: JobConfig, grid: ParallelGrid, attempt: int, *, job_id: str) -> ProcessRankGroup:
        plan = plan_placement(grid, job.gpus_per_node, job.num_nodes)
        return ProcessRankGroup(job, grid, plan, config=self.config)
