"""The placement record: where one rank of an attempt runs, and its grid coordinates.

Every rank builds one when its trainer is up (:meth:`workers.rank.main.RankRunner.placement`):
a local process, a torchrun process or a Ray actor (:mod:`workers.rank.actor`, which adds what
Ray knows). The launcher adds the rank's node in the attempt's placement plan
(:mod:`service.spec.placement`) and names a failed rank from it; :meth:`PlacementRecord.to_dict`
is the form that travels as JSON (the placement event, the job store, ``GET
/api/v1/jobs/{id}/placement``, ``raytron run --json``).

``node_id`` is the Ray node id, and only that: ``None`` for ranks that run as local processes
(there is no Ray node). ``hostname`` is the machine's name, whoever started the rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from workers.grid import COORDS


@dataclass(frozen=True, kw_only=True)
class PlacementRecord:
    rank: int
    node_id: str | None = None
    """The Ray node the rank runs on; None for a local process."""
    node_ip: str | None = None
    """The Ray node's IP (Ray actors only)."""
    hostname: str
    pid: int
    actor_id: str | None = None
    """The rank's Ray actor (Ray actors only)."""
    device: str
    backend: str | None = None
    """torch.distributed's backend, "gloo" or "nccl" (Ray actors only)."""
    world_size: int | None = None
    """The process group's size as torch.distributed sees it (Ray actors only)."""
    gpu_ids: tuple[str, ...] | None = None
    """The GPUs Ray gave the actor (Ray actors only)."""
    local: int | None = None
    """The rank's slot (GPU index) on its node."""
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    etp: int
    expert_dp: int
    resumed_iteration: int = 0
    """The iteration of the checkpoint this attempt loaded (0: from the seed)."""
    resumed_from: str | None = None
    """The checkpoint this attempt loaded, or None."""
    load_s: float = 0.0
    """Seconds the load took."""
    restore_note: str | None = None
    """How the restore went beyond its source: the ranks that took replicas, or why memory was not used."""
    caught_up: list | None = None
    """Rank 0's, after a restore from memory: the metrics of the iterations finished after the driver's last
    record (in the call that failed) up to the one restored; the job controller records them and drops this field."""
    node: int | None = None
    """The rank's node index in the attempt's placement plan (set by the launcher)."""
    reused: bool | None = None
    """Whether the rank's process was kept from the previous attempt (Ray launcher only)."""
    spare: bool | None = None
    """Whether the rank's process was a hot spare before this attempt (resources.spare_nodes; Ray launcher only)."""
    timeline: dict | None = None
    """What the rank did since its process started or its last attempt failed, step by step, wall and CPU
    seconds (:mod:`workers.rank.timeline`; Ray launcher only)."""

    def coords(self) -> dict[str, int]:
        """The coordinates in :data:`workers.grid.COORDS`."""
        return {k: getattr(self, k) for k in COORDS}

    def where(self) -> dict:
        """What a failure of this rank names: plan node, machine (Ray node id, else hostname),
        pid, coordinates."""
        machine = {"node_id": self.node_id} if self.node_id is not None else {"hostname": self.hostname}
        return {"node": self.node, **machine, "pid": self.pid, **self.coords()}

    def to_dict(self) -> dict:
        """Every field, JSON-able (the form events, the store, the REST API and ``raytron run`` carry)."""
        out = asdict(self)
        if self.gpu_ids is not None:
            out["gpu_ids"] = list(self.gpu_ids)
        return out
