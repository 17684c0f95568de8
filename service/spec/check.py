"""A job spec as the API receives it: one problem per entry, sizes bounded.

:func:`service.spec.spec.parse_spec` raises one ``ValueError`` whose message joins every problem;
the REST API answers 422 with one entry per problem (the field path, the message with its
numbers and fix). This adapter gets there through the spec module's own pieces: each section
is validated by its pydantic model (field errors, one per field), and only when all fields are
valid are the cross-field rules of :func:`service.spec.spec.spec_problems` run, each rule's message
becoming one entry. Nothing here duplicates a rule of ``service/spec/spec.py``.

Two things this adapter adds for requests from outside:

* ``priority`` (the queue order in ``raytron serve``, a field of :class:`JobSpec`) gets a message that
  says which way it orders.
* Sizes are bounded (:mod:`service.spec.limits`) before any rank math runs, so that a request
  cannot make the server build 10^9-rank grids or plan 10^12-element tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pydantic import BaseModel, ValidationError

from service.spec.limits import MAX_PRIORITY, MAX_WORLD_SIZE
from service.spec.spec import JobSpec, field_errors, parse_spec, spec_problems
from service.spec.stored import SECTIONS
MAX_TENSOR_ELEMENTS = 10**11
"""Elements of the largest single (unsharded) parameter tensor."""
MAX_TRAIN_ITERS = 10**9

_PATH = re.compile(r"\b((?:model|parallel|training|checkpoint|resources|fault_tolerance)\.[a-z_]+)")
_WORD = re.compile(r"\b([a-z][a-z_]+)\b")


@dataclass
class SpecCheck:
    """The outcome of :func:`check_spec`: ``spec`` when valid, else ``problems`` (never both)."""

    spec: JobSpec | None = None
    problems: list[dict] = field(default_factory=list)


def _problem(path: str, message: str) -> dict:
    return {"field": path, "message": message}


def _field_errors(prefix: str, e: ValidationError) -> list[dict]:
    out = []
    for loc, msg, err in field_errors(e):
        loc = ".".join(x for x in (prefix, loc) if x)
        if err["type"] == "extra_forbidden":
            msg = f"unknown field {loc!r}; check its spelling (Megatron-Core's names)"
        out.append(_problem(loc, msg))
    return out


def _path_of(message: str) -> str:
    """The field a cross-field message is about: the first ``section.field`` or bare field name in it
    (rules name the field they are about first: "model.num_layers 3 is not divisible by ...")."""
    found: list[tuple[int, str]] = []
    m = _PATH.search(message)
    if m:
        found.append((m.start(), m.group(1)))
    for m in _WORD.finditer(message):  # a bare name, e.g. "expert_model_parallel_size 2 needs ..."
        section = next((k for k, model in SECTIONS.items() if m.group(1) in model.model_fields), None)
        if section is not None:
            found.append((m.start(), f"{section}.{m.group(1)}"))
            break
    if found:
        return min(found)[1]
    return "resources" if "world_size" in message else "spec"


def _size_problems(spec: JobSpec) -> list[dict]:
    m, t = spec.model, spec.training
    out = []
    if spec.world_size > MAX_WORLD_SIZE:
        out.append(_problem("resources", f"world_size = resources.num_nodes {spec.resources.num_nodes} x "
                            f"resources.gpus_per_node {spec.resources.gpus_per_node} = {spec.world_size} is more than "
                            f"the {MAX_WORLD_SIZE} ranks raytron plans; lower num_nodes or gpus_per_node"))
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    tensors = {"model.vocab_size x model.hidden_size": m.vocab_size * m.hidden_size,
               "model.ffn_hidden_size x model.hidden_size" + (" x model.num_moe_experts" if m.num_moe_experts else ""):
                   ffn * m.hidden_size * (m.num_moe_experts or 1),
               "model.hidden_size^2": m.hidden_size * m.hidden_size}
    for what, n in tensors.items():
        if n > MAX_TENSOR_ELEMENTS:
            out.append(_problem(what.split(" ")[0], f"{what} = {n:.3g} elements in one tensor, more than the "
                                f"{MAX_TENSOR_ELEMENTS:.0e} allowed; use smaller sizes"))
    if t.train_iters > MAX_TRAIN_ITERS:
        out.append(_problem("training.train_iters", f"training.train_iters {t.train_iters} is more than "
                            f"{MAX_TRAIN_ITERS}; use fewer iterations"))
    sizes = spec.parallel
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        if isinstance(getattr(sizes, name), int) and getattr(sizes, name) > MAX_WORLD_SIZE:  # or "auto"
            out.append(_problem(f"parallel.{name}", f"parallel.{name} {getattr(sizes, name)} is more than "
                                f"{MAX_WORLD_SIZE}; it must divide world_size"))
    return out


ACCELERATOR_FIELDS = ("gpu_type", "gpu_memory_gb", "gpu_peak_tflops")


def with_gpu_type(data: object, gpu_type: str | None) -> object:
    """``data`` with ``resources.gpu_type`` set to the type the cluster reports
    (:func:`service.server.cluster_view.reported_gpu_type`) when the spec describes no accelerator
    of its own (none of :data:`ACCELERATOR_FIELDS`); otherwise as it is. The stored spec then says
    which figures its plan and any ``auto`` layout used."""
    res = data.get("resources") if isinstance(data, dict) else None
    if gpu_type is None or not isinstance(res, dict) or any(k in res for k in ACCELERATOR_FIELDS):
        return data
    return {**data, "resources": {**res, "gpu_type": gpu_type}}


def check_spec(data: object) -> SpecCheck:
    """Validate a request body as a job spec; every problem is one ``{"field", "message"}`` entry."""
    if not isinstance(data, dict):
        return SpecCheck(problems=[_problem("spec", f"a job spec is a JSON object, got {type(data).__name__}")])
    data = dict(data)
    problems: list[dict] = []
    priority = data.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        problems.append(_problem("priority", f"priority must be an integer between -{MAX_PRIORITY} and {MAX_PRIORITY} "
                                 f"(higher runs first), got {priority!r}"))
    sections: dict[str, BaseModel] = {}
    for key, value in data.items():
        if key in ("name", "priority") or key in SECTIONS:
            continue
        problems.append(_problem(key, f"unknown field {key!r}; the spec's sections are name, priority, "
                                 f"{', '.join(SECTIONS)}"))
    name = data.get("name", "job")
    try:
        JobSpec.model_validate({"name": name})  # the name's rules live on JobSpec; the other sections default
    except ValidationError as e:
        problems += [p for p in _field_errors("", e) if p["field"] == "name"]
    for key, model in SECTIONS.items():
        value = data.get(key)
        if value is None:
            value = {}
        try:
            sections[key] = model.model_validate(value)
        except ValidationError as e:
            problems += _field_errors(key, e)
    if problems:
        return SpecCheck(problems=problems)
    candidate = JobSpec.model_construct(name=name, priority=priority, **sections)
    problems = _size_problems(candidate)
    if problems:
        return SpecCheck(problems=problems)
    problems = [_problem(_path_of(msg), msg) for msg in spec_problems(candidate)]
    if problems:
        return SpecCheck(problems=problems)
    try:
        return SpecCheck(spec=parse_spec(data))
    except ValueError as e:  # a rule this adapter did not see separately: still one entry, never a 500
        return SpecCheck(problems=[_problem("spec", str(e))])
