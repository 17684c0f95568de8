"""The result object of ``raytron run`` (what ``--json`` prints last), built from a controller's record.

Its keys: ``job_id``, ``state``, ``iterations``, ``losses``, ``restarts``, ``world_size``,
``sizes``, ``placement`` (per rank exactly :data:`PLACEMENT_KEYS`, read from the ranks'
placement records, :meth:`workers.rank.placement_record.PlacementRecord.to_dict`), each series of
:data:`SERIES` the metrics carry, and ``error`` when the job did not succeed.
"""

from __future__ import annotations

import math

from workers.grid import COORDS, ParallelGrid

PLACEMENT_KEYS = ("rank", "node_id", "pid", *COORDS)
# Global (same on every rank) per-iteration metrics that join ``losses`` when a run reports them.
SERIES = ("lr", "grad_norm", "loss_scale", "val_loss", "moe_aux_loss", "mtp_loss", "loss_tokens", "packing_efficiency")


def result_object(job_id: str, state: str, grid: ParallelGrid, metrics: list[dict], placement: list[dict],
                  restarts: int = 0, error: str | None = None) -> dict:
    """The result object (see the module docstring): ``losses`` and every series in :data:`SERIES`
    the metrics carry, each one value per iteration; non-finite numbers become null (JSON has no NaN)."""
    out = {"job_id": job_id, "state": state, "iterations": len(metrics),
           "losses": [json_number(m["loss"]) for m in metrics], "restarts": restarts,
           "world_size": grid.world_size, "sizes": grid.sizes(),
           "placement": [{k: p.get(k) for k in PLACEMENT_KEYS} for p in placement]}
    for key in SERIES:
        if any(m.get(key) is not None for m in metrics):
            out[key] = [json_number(m.get(key)) for m in metrics]
    if error is not None:
        out["error"] = error
    return out


def json_number(value):
    """``value`` as a JSON-safe number: None for NaN and infinities."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
