"""Job runners: how an admitted job's runner process is started, stopped and found again.

Every runner back end starts the same entry point, ``python -m service.server.job_main JOB_ID --data-dir DIR
--database-url URL``, which reads the spec from the store, runs the job and appends its events
to the store: the store is the single record, so the server never relays progress and a
restarted server loses nothing. A back end only keeps the runner alive or stops it. (Where the
runner then starts the job's *ranks* is the launcher, ``--launcher processes|ray``: see
:mod:`service.ranks.launcher`.)

* :class:`LocalProcessRunners`: the runner is a child process of the server, in its own
  session (a server killed with SIGKILL does not take it along), found again by pid + start time.
* :class:`RayJobsRunners`: the runner is a Ray Job submitted through Ray's job submission API
  (it shows on the dashboard's Jobs page; ``ray_job_id`` is recorded on the job).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Protocol, Sequence

from service.server.logs import job_dir, log_path, read_runner, write_runner
from workers.rank.faults import Fault


class JobRunners(Protocol):
    """Starts and stops job runners. ``job`` is the store's job row (a dict with ``id``, ``spec``...)."""

    def launch(self, job: dict) -> str:
        """Start the job's runner; returns a handle (pid or Ray job id) for the logs."""

    def cancel(self, job_id: str) -> None:
        """Ask the runner to stop (it records CANCELLED itself); force it after a grace period."""

    def is_alive(self, job_id: str) -> bool:
        """Whether the job's runner is still running (after :meth:`reattach` for jobs of an earlier server)."""

    def reattach(self, job: dict) -> bool:
        """After a server restart: find the job's runner again; False when it is gone."""

    # Optional: ``on_exit``, a callable the scheduler sets and a back end that can tell calls with the job's
    # id as soon as a runner it started exits (the scheduler then looks at once instead of at its next poll).


def runner_command(job_id: str, data_dir: str | Path, database_url: str, *, launcher: str = "processes",
                   faults: Sequence[Fault] = ()) -> list[str]:
    """The runner's command line.

    Args:
        launcher: where the runner starts the job's ranks (``processes`` on this machine, ``ray``
            as actors on the Ray cluster the runner is a job of).
        faults: failure drills for the job (``raytron serve --fault``), one ``--fault RANK@ITER:KIND``
            each: the command line is what reaches a Ray Job's entry point (not the server's
            environment).
    """
    drills = [arg for f in faults for arg in ("--fault", str(f))]
    return [sys.executable, "-m", "service.server.job_main", job_id, "--data-dir", str(data_dir),
            "--database-url", database_url, "--launcher", launcher, *drills]


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None when it is gone or a zombie;
    with the pid it identifies a process across pid reuse."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


class LocalProcessRunners:
    """Runs each job as a separate OS process on this machine.

    Args:
        data_dir: the service's data dir (logs and runner records go under ``jobs/JOB_ID``).
        database_url: the store the runner writes to.
        cancel_grace_s: after SIGTERM, how long the runner may take to record CANCELLED and stop
            its ranks before its whole process group is killed.
        env: extra environment for the runner.
        faults: failure drills applied to every job (``raytron serve --fault``; see :func:`runner_command`).
    """

    def __init__(self, data_dir: str | Path, database_url: str, *, cancel_grace_s: float = 10.0,
                 env: dict | None = None, faults: Sequence[Fault] = ()):
        self.data_dir, self.database_url = Path(data_dir), database_url
        self.cancel_grace_s = cancel_grace_s
        self.env = env or {}
        self.faults = list(faults)
        self._procs: dict[str, subprocess.Popen] = {}
        self._pids: dict[str, tuple[int, int]] = {}  # job id -> (pid, start time), for reattached runners
        self.on_exit: Callable[[str], None] | None = None  # told the job's id when a runner it started exits

    def launch(self, job: dict) -> str:
        folder = job_dir(self.data_dir, job["id"])
        folder.mkdir(parents=True, exist_ok=True)
        with open(log_path(self.data_dir, job["id"]), "ab") as log:
            proc = subprocess.Popen(runner_command(job["id"], self.data_dir, self.database_url, faults=self.faults),
                                    stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"})
        self._procs[job["id"]] = proc
        self._pids[job["id"]] = (proc.pid, _start_time(proc.pid) or 0)
        write_runner(self.data_dir, job["id"], {"kind": "process", "pid": proc.pid,
                                                "start_time": self._pids[job["id"]][1]})
        threading.Thread(target=self._exited, args=(job["id"], proc), daemon=True,
                         name=f"runner-{job['id']}").start()
        return str(proc.pid)

    def _exited(self, job_id: str, proc: subprocess.Popen) -> None:
        """Wait for the runner to exit, then say so (``on_exit``): its slots may free at once."""
        proc.wait()  # while it blocks, poll() in is_alive answers None (alive), as it should
        if self.on_exit is not None:
            self.on_exit(job_id)

    def is_alive(self, job_id: str) -> bool:
        proc = self._procs.get(job_id)
        if proc is not None:
            return proc.poll() is None
        pid, started = self._pids.get(job_id, (0, 0))
        return bool(pid) and _start_time(pid) == started

    def reattach(self, job: dict) -> bool:
        record = read_runner(self.data_dir, job["id"])
        if not record or record.get("kind") != "process":
            return False
        self._pids[job["id"]] = (record["pid"], record["start_time"])
        return self.is_alive(job["id"])

    def pid(self, job_id: str) -> int | None:
        return self._pids.get(job_id, (None, 0))[0]

    def cancel(self, job_id: str) -> None:
        if not self.is_alive(job_id):
            return
        pid = self._pids[job_id][0]
        try:
            os.kill(pid, signal.SIGTERM)  # the runner records CANCELLED and stops its ranks
        except ProcessLookupError:
            return
        deadline = time.monotonic() + self.cancel_grace_s
        while time.monotonic() < deadline and self.is_alive(job_id):
            time.sleep(0.05)
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever the runner left behind (its session = its pid)
        except (ProcessLookupError, PermissionError):
            pass
        self.reap(job_id)

    def reap(self, job_id: str) -> None:
        """Collect an exited child (no zombie left)."""
        proc = self._procs.get(job_id)
        if proc is not None and proc.poll() is not None:
            self._procs.pop(job_id, None)
            self._pids[job_id] = (proc.pid, -1)  # gone: never alive again, even if the pid is reused

    def close(self) -> None:
        """Forget the children (they run on: a restarted server reattaches to them)."""
        self._procs.clear()
