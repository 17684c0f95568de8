"""A simulated Ray cluster in a process of its own: the outside cluster of a test (``RAY_ADDRESS``),
which outlives the runners and servers connected to it, as a real one does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from service.ranks.proc_tree import marked, matching
from service.ranks.ray_cluster import CLUSTER_MARK
from tests.helpers.paths import ROOT

HOST = """
import sys
from service.ranks.ray_cluster import simulated_cluster
with simulated_cluster(int(sys.argv[2]), int(sys.argv[3]), record=sys.argv[1], accelerator=sys.argv[4] or None) as session:
    print("READY", session.address, flush=True)
    sys.stdin.read()  # until the test closes it
"""


class HostedCluster:
    """A head node and ``nodes`` worker nodes of ``gpus`` GPU slots, started by another process;
    ``accelerator``: the worker nodes carry Ray's label of that GPU (``accelerator_type:H100``).

    Attributes:
        address: the GCS address (what ``RAY_ADDRESS`` names).
        data: the cluster's record (its id, temporary folder, dashboard).
    """

    def __init__(self, tmp_path: Path, nodes: int = 2, gpus: int = 2, accelerator: str | None = None):
        self.record = Path(tmp_path) / "hosted_ray_cluster.json"
        self.proc = subprocess.Popen([sys.executable, "-c", HOST, str(self.record), str(nodes), str(gpus),
                                      accelerator or ""], cwd=ROOT,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), line
        self.address = line.split()[1]
        self.data = json.loads(self.record.read_text())

    def env(self) -> dict:
        """The environment of a process on this cluster's machine that connects through ``RAY_ADDRESS``
        (loopback addresses, no token auth, Ray's files in the cluster's folder)."""
        return {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": self.address,
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                "RAY_TMPDIR": self.data["temp_dir"]}

    def processes(self) -> set[int]:
        """Every process of the cluster (its mark is in their environment)."""
        return marked(CLUSTER_MARK, self.data["cluster_id"])

    def _gcs_alive(self) -> bool:
        mine = self.processes()
        return any(p in mine for p in matching(lambda argv: argv[0].endswith("gcs_server")))

    def close(self) -> None:
        """Stop the cluster, and check that nothing of it is left."""
        from service.ranks.ray_cluster import stop_marked_cluster

        if self.proc.poll() is None:
            if self._gcs_alive():
                self.proc.stdin.close()
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            else:  # the head was lost: the host's shutdown would only wait on it (~15 s); reaped below
                self.proc.kill()
                self.proc.wait()
        stop_marked_cluster(self.data["cluster_id"], self.data["temp_dir"], self.record)
        assert self.processes() == set()
