"""The job spec: pydantic at the edge, frozen configs inside (``examples/tiny-5d.yaml`` shows every field).

Field names are Megatron-Core's. Unknown fields are refused (a typo must not be ignored), types
are strict (``tp: "2"`` or ``tp: true`` is an error, not a 2 or a 1), numbers must be finite,
and no field is accepted and ignored. The sections are :mod:`service.spec.sections`. Every
cross-field rule is checked by :func:`spec_problems` (the layout's with :mod:`service.spec.layout_rules`,
each feature's with its own module), before anything starts, and each message names the fields,
the numbers and the fix. :func:`grid_of` is the one place a spec becomes a rank grid, and
:func:`to_job_config` the one place it becomes the internal :class:`workers.config.JobConfig`.

``parallel: auto`` (or single fields ``auto``) is resolved as the spec is read, before any rule:
:class:`JobSpec` writes the layout :mod:`service.spec.auto` chooses into the data, so a JobSpec is
always concrete and what is stored and run is the chosen layout; :func:`search_layouts` gives the
ranking itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError, model_validator

from service.spec.auto import PARALLEL_AUTO, auto_fields, resolve, search_once
from service.spec.errors import field_errors, format_validation_error, read_spec_file  # noqa: F401 (interface)
from service.spec.checkpoint import retention_problems
from service.spec.documents import document_problems
from service.spec.chat import chat_problems
from service.spec.fp8 import fp8_problems
from service.spec.from_hf import from_hf_problems
from service.spec.megatron_load import megatron_load_problems, megatron_save_problems
from service.spec.layout_rules import layout_problems, recompute_problems
from service.spec.limits import MAX_PRIORITY, check_memory, check_world_size
from service.spec.mla import mla_problems
from service.spec.pipeline import pipeline_problems
from service.spec.tracking import TrackingSpec
from service.spec.model_section import ModelSpec  # noqa: F401 (the sections are part of this module's interface)
from service.spec.sections import (  # noqa: F401 (the sections are part of this module's interface)
    STRICT, Auto, CheckpointSpec, FaultToleranceSpec, ParallelSpec, ResourcesSpec, TrainingSpec,
    resources_problems, training_problems)
from workers.config import CheckpointConfig, JobConfig, ModelConfig, ParallelConfig, TrainingConfig
from workers.grid import ParallelGrid

class JobSpec(BaseModel):
    """A training job. Unknown fields are errors."""

    model_config = STRICT
    name: str = Field("job", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="queue order in `raytron serve`: higher first, "
                          "then submission time (`raytron run` starts at once)")
    model: ModelSpec = ModelSpec()
    parallel: ParallelSpec | Auto = Field(ParallelSpec(), description="the layout, or auto (chosen by the cost "
                                          "model when the spec is read; any field may be auto too)")
    training: TrainingSpec = TrainingSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    resources: ResourcesSpec = ResourcesSpec()
    fault_tolerance: FaultToleranceSpec = FaultToleranceSpec()
    tracking: TrackingSpec = Field(TrackingSpec(), description="experiment trackers (MLflow, W&B) for the "
                                   "job's curves, parameters and events")

    @property
    def world_size(self) -> int:
        return self.resources.num_nodes * self.resources.gpus_per_node

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto(cls, data):
        """Write the layout the cost model chooses into ``auto`` fields (:mod:`service.spec.auto`), so a
        JobSpec is always concrete. Invalid sections are left to the field validation to report."""
        if not auto_fields(data):
            return data
        sections = {"model": ModelSpec, "parallel": ParallelSpec, "training": TrainingSpec,
                    "resources": ResourcesSpec}
        for key, model in sections.items():
            value = data.get(key)
            if value is not None and not isinstance(value, model):
                try:
                    model.model_validate(value)
                except ValidationError:
                    return data
        return resolve(data, _validate_concrete)

    @model_validator(mode="after")
    def _check(self) -> "JobSpec":
        problems = spec_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _validate_concrete(data: dict) -> JobSpec:
    """The validation :func:`service.spec.auto.search` applies to each candidate layout."""
    return JobSpec.model_validate(data)


def search_layouts(data: dict) -> dict:
    """The cost model's ranking of the layouts a spec's ``auto`` fields allow (:func:`service.spec.auto.search`);
    a spec with none open is searched with its whole parallel section open (``raytron plan --auto``)."""
    data = dict(data)
    if not auto_fields(data):
        par = data.get("parallel") or {}
        data["parallel"] = {**(par if isinstance(par, dict) else {}), **{k: "auto" for k in PARALLEL_AUTO}}
    return search_once(data, _validate_concrete)


def grid_of(spec: JobSpec, world_size: int | None = None) -> ParallelGrid:
    """The rank grid of a spec's parallel section on its world size (or on ``world_size`` ranks).
    Raises ValueError when the sizes do not fit the world."""
    return ParallelGrid.from_config(spec.parallel, spec.world_size if world_size is None else world_size)


def batch_problem(global_batch_size: int, micro_batch_size: int, grid: ParallelGrid) -> str:
    """The global-batch rule for one grid, or "": the batch splits into whole microbatches of every
    dp replica, and the interleaved schedule (``grid.vpp``) needs a multiple of pp of them. The one
    rule both the spec's validation and the elastic policy (a resized dp) apply."""
    per_step = micro_batch_size * grid.dp
    if global_batch_size % per_step:
        return (f"training.global_batch_size {global_batch_size} is not divisible by micro_batch_size "
                f"{micro_batch_size} x dp {grid.dp} = {per_step}; use a multiple of {per_step}")
    if grid.vpp and (global_batch_size // per_step) % grid.pp:
        return (f"the interleaved schedule needs the number of microbatches ({global_batch_size // per_step}) "
                f"to be a multiple of pipeline_model_parallel_size {grid.pp}")
    return ""


def spec_problems(spec: JobSpec) -> list[str]:
    """Every cross-field problem of a spec, each naming fields, numbers and the fix."""
    fields = auto_fields(spec.model_dump())
    if fields:  # a spec put together without validation (service.spec.check): the search is its check
        try:
            resolve(spec.model_dump(), _validate_concrete)
        except ValueError as e:
            return [str(e)]
        return resources_problems(spec.resources)
    m, p, t, res = spec.model, spec.parallel, spec.training, spec.resources
    out: list[str] = from_hf_problems(m)
    world = spec.world_size
    try:
        check_world_size(world, f"world_size = resources.num_nodes {res.num_nodes} x resources.gpus_per_node "
                                f"{res.gpus_per_node} =")
    except ValueError as e:
        return [str(e)]  # nothing below may enumerate a world that large
    try:
        grid = grid_of(spec)
    except ValueError as e:
        out.append(f"{e} (world_size = resources.num_nodes {res.num_nodes} x resources.gpus_per_node {res.gpus_per_node})")
        grid = None
    out.extend(layout_problems(m, p, res.gpus_per_node))
    if grid is not None and (problem := batch_problem(t.global_batch_size, t.micro_batch_size, grid)):
        out.append(problem)
    out.extend(recompute_problems(m, p.pipeline_model_parallel_size))
    out.extend(pipeline_problems(p, m, t, grid.dp if grid is not None else None))
    if m.mtp_num_layers and m.mtp_num_layers >= m.seq_length - 1:
        out.append(f"model.mtp_num_layers {m.mtp_num_layers} leaves no token with a target in a sequence of "
                   f"model.seq_length {m.seq_length}; use at most {max(m.seq_length - 2, 1)} MTP layers")
    if not m.mtp_num_layers and m.mtp_loss_scaling_factor != type(m).model_fields["mtp_loss_scaling_factor"].default:
        out.append(f"model.mtp_loss_scaling_factor {m.mtp_loss_scaling_factor} is set but model.mtp_num_layers is "
                   f"null (no MTP loss to scale); set mtp_num_layers, or drop mtp_loss_scaling_factor")
    out.extend(mla_problems(m))
    out.extend(training_problems(t) + document_problems(t, m.vocab_size, m.mtp_num_layers))
    out.extend(fp8_problems(m, p, t, spec.resources.gpu_type))
    out.extend(chat_problems(t, m))
    out.extend(retention_problems(spec.checkpoint, t))
    out.extend(megatron_load_problems(spec.checkpoint, m))
    out.extend(megatron_save_problems(spec.checkpoint, m))
    out.extend(resources_problems(res))
    if res.min_nodes is not None and res.min_nodes > res.num_nodes:
        out.append(f"resources.min_nodes {res.min_nodes} > resources.num_nodes {res.num_nodes}: the elastic floor "
                   f"cannot be above the job's size; lower min_nodes")
    if spec.fault_tolerance.relayout_on_resize and (res.min_nodes or res.num_nodes) >= res.num_nodes:
        out.append(f"fault_tolerance.relayout_on_resize re-picks the layout when an elastic job shrinks, but "
                   f"resources.min_nodes {res.min_nodes} is not below num_nodes {res.num_nodes}: set min_nodes "
                   f"below num_nodes, or drop relayout_on_resize")
    ft = spec.fault_tolerance
    if ft.memory_interval and ft.memory_replicas >= res.num_nodes:
        out.append(f"fault_tolerance.memory_replicas {ft.memory_replicas} needs more than {ft.memory_replicas} "
                   f"node(s) (each replica on another node), but resources.num_nodes is {res.num_nodes}: add nodes, "
                   f"lower memory_replicas, or set memory_interval 0")
    if not out:
        try:
            check_memory(to_job_config(spec))
        except ValueError as e:
            out.append(str(e))
    return out


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML or JSON spec file. Raises ValueError with readable reasons."""
    data = read_spec_file(path)
    try:
        return parse_spec(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def parse_spec(data) -> JobSpec:
    """Validate a spec already read (a dict). Raises ValueError with every reason."""
    if not data:
        raise ValueError("the job spec is empty; give at least model, training and resources "
                         "(see examples/tiny-5d.yaml)")
    if not isinstance(data, dict):
        raise ValueError(f"a job spec is a mapping of sections (model, parallel, training, ...), "
                         f"got a {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise ValueError(format_validation_error(e)) from None


def _by_name(config_cls, section: BaseModel, **derived):
    """A worker config from a spec section: every field both declare is copied by name (a list becomes
    a tuple: the configs are frozen), ``derived`` gives the fields computed from others.
    tests/service/spec/test_config_agreement.py holds the two sides to the same names, types and defaults."""
    names = [f.name for f in dataclasses.fields(config_cls) if f.name in type(section).model_fields
             and f.name not in derived]
    values = {n: getattr(section, n) for n in names}
    return config_cls(**{n: tuple(v) if isinstance(v, list) else v for n, v in values.items()}, **derived)


def to_job_config(spec: JobSpec) -> JobConfig:
    """The one conversion from the user-facing spec to the frozen internal config."""
    m, p, t = spec.model, spec.parallel, spec.training
    model = _by_name(
        ModelConfig, m, num_query_groups=m.num_query_groups or m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        kv_channels=None if m.kv_channels and m.kv_channels * m.num_attention_heads == m.hidden_size else m.kv_channels,
    )
    parallel = _by_name(ParallelConfig, p,
                        expert_tensor_parallel_size=p.expert_tensor_parallel_size or p.tensor_model_parallel_size)
    training = _by_name(TrainingConfig, t, data=tuple(str(x) for x in t.data) if isinstance(t.data, list) else t.data,
                        chat_tokenizer=t.chat_tokenizer or (m.from_hf if t.chat_data else None))
    checkpoint = _by_name(CheckpointConfig, spec.checkpoint,
                          hf_tokenizer=spec.checkpoint.hf_tokenizer or training.chat_tokenizer or m.from_hf)
    return JobConfig(
        checkpoint=checkpoint, min_nodes=spec.resources.min_nodes, spare_nodes=spec.resources.spare_nodes,
        node_grace_s=spec.fault_tolerance.node_grace_s,
        name=spec.name, model=model, parallel=parallel, training=training, world_size=spec.world_size,
        num_nodes=spec.resources.num_nodes, gpus_per_node=spec.resources.gpus_per_node,
        max_restarts=spec.fault_tolerance.max_restarts, max_preemptions=spec.fault_tolerance.max_preemptions,
        sigterm_grace_s=spec.fault_tolerance.sigterm_grace_s,
        collective_timeout_s=spec.fault_tolerance.collective_timeout_s,
        relayout_spec=spec.model_dump_json() if spec.fault_tolerance.relayout_on_resize else None,
        memory_interval=spec.fault_tolerance.memory_interval, memory_replicas=spec.fault_tolerance.memory_replicas,
    )
