"""A scheduler over a real store with scripted runners in place of real job runners."""

from __future__ import annotations

from service.spec.spec import parse_spec


class FakeRunners:
    """Runners that live until the test ends them."""

    def __init__(self):
        self.launched: list[str] = []
        self.alive: set[str] = set()
        self.cancelled: list[str] = []
        self.known: set[str] = set()  # what reattach finds (runners of an earlier server)

    def launch(self, job):
        self.launched.append(job["id"])
        self.alive.add(job["id"])
        return job["id"]

    def cancel(self, job_id):
        self.cancelled.append(job_id)
        self.alive.discard(job_id)

    def is_alive(self, job_id):
        return job_id in self.alive

    def reattach(self, job):
        if job["id"] in self.known:
            self.alive.add(job["id"])
            return True
        return False


def spec(name, nodes=1, gpus=2, priority=0):
    return parse_spec({"name": name, "priority": priority, "resources": {"num_nodes": nodes, "gpus_per_node": gpus},
                       "training": {"global_batch_size": nodes * gpus * 2, "micro_batch_size": 1}})


def finish(store, launcher, job_id, state="SUCCEEDED"):
    for s in ("STARTING", "RUNNING", state):
        store.update_job(job_id, state=s)
    launcher.alive.discard(job_id)
