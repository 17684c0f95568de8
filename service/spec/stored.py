"""A job spec's sections by name, and a stored spec's sections read back through their types.

A job is stored as its :class:`~service.spec.spec.JobSpec`'s JSON (``model_dump(mode="json")``).
Whoever reads a stored job (the scheduler, the REST views) reads a section through its pydantic type
with :func:`stored_section`, so a default is written once, in :mod:`service.spec.sections`, never
typed again as ``.get(key, default)``.
"""

from __future__ import annotations

from pydantic import BaseModel

from service.spec.model_section import ModelSpec
from service.spec.sections import CheckpointSpec, FaultToleranceSpec, ParallelSpec, ResourcesSpec, TrainingSpec
from service.spec.tracking import TrackingSpec

SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelSpec, "parallel": ParallelSpec, "training": TrainingSpec, "checkpoint": CheckpointSpec,
    "resources": ResourcesSpec, "fault_tolerance": FaultToleranceSpec, "tracking": TrackingSpec,
}


def stored_section(spec: dict | None, name: str):
    """Section ``name`` of a stored spec: the values it holds, the section's own defaults for the rest
    (no validation: the spec was validated when it was submitted)."""
    values = (spec or {}).get(name)
    return SECTIONS[name].model_construct(**(values if isinstance(values, dict) else {}))
