"""One rank as a local process, driven over a command pipe (the ``--launcher processes`` back end).

The launcher (``service/ranks/process_launcher.py``) starts one process per rank with
:func:`rank_process_main` and talks to it over a duplex pipe:

==================  ================================================================
launcher -> rank    ``("run", n)``: n iterations; ``("save_now",)``: a checkpoint of the
                    current iteration (answered ``("saved", {...})``); ``("shutdown",)``: leave and exit
rank -> launcher    ``("ready", record)`` after rendezvous and trainer construction (its
                    :class:`~workers.rank.placement_record.PlacementRecord`);
                    ``("metrics", [per-iteration dicts])`` after each run;
                    ``("error", cause, traceback)`` and exit, when anything raised;
                    ``("port_in_use", message)`` when the rendezvous port was taken;
                    ``("stall", group kind)`` when a hang drill blocks in a collective;
                    ``("notice", {"signal", "time", "deadline"})`` before a run's metrics,
                    once, when the process got a SIGTERM (a preemption notice:
                    :class:`~workers.rank.main.SigtermNotice`)
==================  ================================================================

A rank that raised exits: its process groups are broken, and the controller decides whether a
new attempt (with new processes) follows.
"""

from __future__ import annotations

import signal
import traceback

from workers.config import JobConfig

PORT_IN_USE = "address already in use"


def rank_process_main(conn, rank: int, world_size: int, job: JobConfig, master_addr: str, master_port: int,
                      local_rank: int, collective_timeout_s: float, faults: tuple) -> None:
    """Entry point of a rank process (see the module docstring)."""
    # Ctrl-C reaches the whole terminal process group; the launcher alone decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from workers.rank.main import RankRunner, SigtermNotice, abort_process_groups
    from workers.rank.distributed import init_distributed, rank_device

    sigterm = SigtermNotice(job.sigterm_grace_s).install()  # a SIGTERM is a notice, not an exit
    try:
        try:
            init_distributed(rank, world_size, master_addr, master_port, timeout_s=collective_timeout_s)
        except Exception as exc:  # noqa: BLE001
            if PORT_IN_USE in str(exc).lower():
                conn.send(("port_in_use", str(exc)))
                return
            raise
        runner = RankRunner(job, rank, world_size, device=rank_device(local_rank), faults=faults,
                            on_stall=lambda kind: conn.send(("stall", kind)))
        conn.send(("ready", runner.placement(local=local_rank)))
        while True:
            try:
                command = conn.recv()
            except EOFError:  # the launcher is gone
                return
            if command[0] == "run":
                metrics = runner.run(command[1])
                if (notice := sigterm.take()) is not None:
                    conn.send(("notice", notice))
                conn.send(("metrics", metrics))
            elif command[0] == "save_now":
                conn.send(("saved", runner.save_now()))
            else:
                runner.close()
                return
    except BaseException as exc:  # noqa: BLE001 - everything must reach the launcher
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except (OSError, EOFError):
            pass
    finally:
        abort_process_groups()
        conn.close()
