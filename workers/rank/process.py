"""One rank as a local process, driven over a command pipe (the ``--launcher processes`` back end).

The launcher (``service/ranks/process_launcher.py``) starts one process per rank with
:func:`rank_process_main` and talks to it over a duplex pipe:

==================  ================================================================
launcher -> rank    ``("run", n)``: n iterations; ``("save_now",)``: a checkpoint of the
                    current iteration (answered ``("saved", {...})``); ``("reset",)``: forget
                    the attempt, keep the process (answered ``("reset", pid)``);
                    ``("setup", args)``: join the next attempt (:func:`rank_process_main`'s
                    arguments after ``conn`` and ``rank``); ``("shutdown",)``: leave and exit
rank -> launcher    ``("ready", record)`` after rendezvous and trainer construction (its
                    :class:`~workers.rank.placement_record.PlacementRecord`);
                    ``("metrics", [per-iteration dicts])`` after each run;
                    ``("error", cause, traceback)`` when anything raised;
                    ``("port_in_use", message)`` when the rendezvous port was taken;
                    ``("stall", group kind)`` when a hang drill blocks in a collective;
                    ``("notice", {"signal", "time", "deadline"})`` before a run's metrics,
                    once, when the process got a SIGTERM (a preemption notice:
                    :class:`~workers.rank.main.SigtermNotice`)
==================  ================================================================

A rank that raised exits: its process groups are broken, and the controller decides whether a
new attempt (with new processes) follows. With in-memory checkpoints
(``fault_tolerance.memory_interval``) it stays instead, as a Ray rank actor does: it forgets the
attempt (its trainer and process groups, so that its peers fail at once) before it reports the
error, keeps its :class:`~workers.rank.replicas.MemoryStore`, and the next attempt ``setup``\\ s it
again, to restore from the snapshots and replicas it holds.
"""

from __future__ import annotations

import os
import signal
import traceback

from workers.config import JobConfig

PORT_IN_USE = "address already in use"


def rank_process_main(conn, rank: int, world_size: int, job: JobConfig, master_addr: str, master_port: int,
                      local_rank: int, collective_timeout_s: float, faults: tuple, node: int | None = None) -> None:
    """Entry point of a rank process (see the module docstring)."""
    # Ctrl-C reaches the whole terminal process group; the launcher alone decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from workers.rank.distributed import leave_process_groups
    from workers.rank.main import SigtermNotice

    sigterm = SigtermNotice(job.sigterm_grace_s).install()  # a SIGTERM is a notice, not an exit
    rank_ = _Rank(conn, rank, keep=bool(job.memory_interval))
    try:
        command = ("setup", (world_size, job, master_addr, master_port, local_rank, collective_timeout_s, faults, node))
        while command[0] != "shutdown":
            if command[0] == "reset":
                rank_.forget()
                conn.send(("reset", os.getpid()))
            elif not rank_.serve(command, sigterm):
                return
            try:
                command = conn.recv()
            except EOFError:  # the launcher is gone
                return
        rank_.forget()
    except BaseException as exc:  # noqa: BLE001 - everything must reach the launcher
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except (OSError, EOFError):
            pass
    finally:
        leave_process_groups()  # closes this rank's connections; peers fail fast
        conn.close()


class _Rank:
    """The process's rank across attempts: this attempt's runner and the in-memory store it keeps."""

    def __init__(self, conn, rank: int, keep: bool):
        self.conn, self.rank, self.keep = conn, rank, keep
        self.runner = None
        self.memory = None  # workers.rank.replicas.MemoryStore, kept across attempts
        self.reapers: list = []  # the threads freeing the last attempt's process groups (forget())

    def serve(self, command: tuple, sigterm) -> bool:
        """Answer ``command``; False when the process is to exit (the error is sent, or raised
        when the process does not stay after one)."""
        try:
            if command[0] == "setup":
                return self.setup(*command[1])
            if command[0] == "run":
                metrics = self.runner.run(command[1])
                if (notice := sigterm.take()) is not None:
                    self.conn.send(("notice", notice))
                self.conn.send(("metrics", metrics))
            elif command[0] == "save_now":
                self.conn.send(("saved", self.runner.save_now()))
            return True
        except BaseException as exc:  # noqa: BLE001 - reported below, after the attempt is forgotten
            if not self.keep:
                raise
            error = (f"{type(exc).__name__}: {exc}", traceback.format_exc())
        self.forget()  # outside the handler: nothing holds the trainer's groups, the peers fail now
        self.conn.send(("error", *error))
        return True

    def setup(self, world_size: int, job: JobConfig, master_addr: str, master_port: int, local_rank: int,
              collective_timeout_s: float, faults: tuple, node: int | None) -> bool:
        from workers.rank.distributed import init_distributed, rank_device
        import torch

        from workers.rank.main import RankRunner

        if torch.cuda.is_available():
            for thread in self.reapers:
                thread.join()  # the last attempt's communicators gone before this one's
        try:
            init_distributed(self.rank, world_size, master_addr, master_port, timeout_s=collective_timeout_s)
        except Exception as exc:  # noqa: BLE001
            if PORT_IN_USE in str(exc).lower():
                self.conn.send(("port_in_use", str(exc)))
                return False
            raise
        if job.memory_interval and self.memory is None:
            from workers.rank.replicas import MemoryStore

            self.memory = MemoryStore()
        self.runner = RankRunner(job, self.rank, world_size, device=rank_device(local_rank), faults=faults,
                                 on_stall=lambda kind: self.conn.send(("stall", kind)), node=node, memory=self.memory)
        self.conn.send(("ready", self.runner.placement(local=local_rank)))
        return True

    def forget(self) -> None:
        """Leave the attempt, keep the process and its in-memory store."""
        from workers.rank.main import forget_attempt

        self.reapers = forget_attempt(self)
