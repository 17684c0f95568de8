"""Jobs as Ray Jobs: the runner submitted through Ray's job submission API, and Ray's view of the nodes.

:class:`RayJobsRunners` submits the same entry point as the local launcher
(``python -m service.server.job_main JOB_ID ...``, see :mod:`service.server.runners`) as a Ray Job whose
submission id is ``raytron-JOB_ID`` (``raytron-JOB_ID-N`` for the job's N-th runner, when
earlier ones were lost), so the job shows on the dashboard's Jobs page with its logs, and a
restarted server finds it again by that id (kept in the job's runner record). The id is
recorded as the job's ``ray_job_id``. The entry point's output is also appended to ``DATA_DIR/jobs/JOB_ID/driver.log``
(``tee``), where ``GET /api/v1/jobs/{id}/logs`` reads; the data dir and the database must be
reachable from the node that runs the entry point (Ray runs it on the head node by default,
where ``raytron serve`` runs).

Cancel is Ray's ``stop_job``: SIGTERM to the entry point (the runner records CANCELLED and stops
its ranks), then SIGKILL after Ray's grace period.

:class:`RayClusterView` lists the alive Ray nodes and their GPU resources (a connected driver).
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Sequence

from service.server.runners import runner_command
from service.server.logs import job_dir, log_path, read_runner, write_runner
from service.server.scheduler import NodeSlots
from service.server.store import JobStore
from workers.rank.faults import Fault

ALIVE = ("PENDING", "RUNNING")


def submission_id(job_id: str, runner: int = 1) -> str:
    """The Ray Job submission id of the job's ``runner``-th runner."""
    return f"raytron-{job_id}" if runner == 1 else f"raytron-{job_id}-{runner}"


class RayJobsRunners:
    """Runs each job as a Ray Job.

    Args:
        data_dir: the service's data dir (logs, runner records).
        database_url: the store the runner writes to.
        store: the same store, to record ``ray_job_id``.
        dashboard_url: the Ray dashboard (job submission API), e.g. ``http://127.0.0.1:8265``.
        env: environment variables for the entry point (``runtime_env``).
        submit_timeout_s: how long to retry a submission the cluster is not ready for yet.
        faults: failure drills applied to every job (``raytron serve --fault``), passed on the
            entry point's command line (see :func:`service.server.runners.runner_command`).
    """

    def __init__(self, data_dir: str | Path, database_url: str, store: JobStore, dashboard_url: str, *,
                 env: dict | None = None, submit_timeout_s: float = 180.0, faults: Sequence[Fault] = ()):
        from ray.job_submission import JobSubmissionClient

        self.data_dir, self.database_url, self.store = Path(data_dir), database_url, store
        self.client = JobSubmissionClient(dashboard_url)
        self.env = env or {}
        self.faults = list(faults)
        self.submit_timeout_s = submit_timeout_s
        self._sids: dict[str, str] = {}  # job id -> its current runner's submission id

    def launch(self, job: dict) -> str:
        job_dir(self.data_dir, job["id"]).mkdir(parents=True, exist_ok=True)
        command = " ".join(shlex.quote(x) for x in runner_command(job["id"], self.data_dir, self.database_url,
                                                                 launcher="ray", faults=self.faults))
        log = shlex.quote(str(log_path(self.data_dir, job["id"])))
        # pipefail: the Ray job's status is the runner's, not tee's
        entrypoint = f"bash -o pipefail -c {shlex.quote(f'{command} 2>&1 | tee -a {log}')}"
        record = read_runner(self.data_dir, job["id"]) or {}
        runner = int(record.get("runner", 0)) + 1 if record.get("kind") == "ray_job" else 1
        deadline = time.monotonic() + self.submit_timeout_s
        while True:
            try:
                sid = self.client.submit_job(entrypoint=entrypoint, submission_id=submission_id(job["id"], runner),
                                             runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1", **self.env}},
                                             metadata={"raytron_job_id": job["id"], "name": job["name"]})
                break
            except RuntimeError as e:
                # A cluster that just started has no job agent yet ("No available agent ... try again later")
                if "try again" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
        write_runner(self.data_dir, job["id"], {"kind": "ray_job", "submission_id": sid, "runner": runner})
        self._sids[job["id"]] = sid
        self.store.update_job(job["id"], ray_job_id=sid)
        return sid

    def _sid(self, job_id: str) -> str:
        """The submission id of the job's current runner (from its record after a server restart)."""
        if job_id not in self._sids:
            record = read_runner(self.data_dir, job_id) or {}
            self._sids[job_id] = record.get("submission_id") or submission_id(job_id)
        return self._sids[job_id]

    def _status(self, job_id: str) -> str | None:
        try:
            return str(self.client.get_job_status(self._sid(job_id)).value)
        except Exception:  # noqa: BLE001 - unknown to Ray (never submitted, or the cluster was replaced)
            return None

    def is_alive(self, job_id: str) -> bool:
        return self._status(job_id) in ALIVE

    def reattach(self, job: dict) -> bool:
        self._sids.pop(job["id"], None)  # read the record again
        return self.is_alive(job["id"])

    def cancel(self, job_id: str) -> None:
        if self.is_alive(job_id):
            self.client.stop_job(self._sid(job_id))


class RayClusterView:
    """The alive nodes of the Ray cluster this process is connected to that have GPU slots (the
    nodes a job's ranks can run on: a head node without GPUs holds only the job runners)."""

    def __init__(self, ray_address: str, dashboard_url: str | None):
        self.ray_address, self.dashboard_url = ray_address, dashboard_url

    def nodes(self) -> list[NodeSlots]:
        import ray

        return [NodeSlots(n["NodeID"], int(n.get("Resources", {}).get("GPU", 0)), bool(n.get("Alive")),
                          _accelerator(n.get("Resources", {})))
                for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]


def _accelerator(resources: dict) -> str | None:
    """The accelerator Ray labels a node with: its ``accelerator_type:<name>`` resource (Ray sets it
    on a GPU node it recognises, e.g. ``accelerator_type:H100``; ray.util.accelerators)."""
    found = sorted(k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:"))
    return found[0] if len(found) == 1 else None
