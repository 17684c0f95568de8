"""One config vocabulary: a field the job spec (pydantic, :mod:`service.spec.sections`) and the worker
configs (frozen dataclasses, :mod:`workers.config`) both declare has one name, one type and one
default, and ``to_job_config`` copies it by name. A field only one side has is listed here with why."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
from pydantic import BaseModel

from service.spec import spec  # the spec module holds every section
from service.spec.spec import parse_spec, to_job_config
from workers import config

# Only the spec has these: read at the edge, never by a rank.
ONLY_SPEC = {
    "model.from_hf": "fills the other model fields from a config.json when the spec is read",
    "resources.gpu_type": "the cost model's accelerator figures (planning only)",
    "resources.gpu_memory_gb": "planning only", "resources.gpu_peak_tflops": "planning only",
    "resources.intra_node_bandwidth_gbps": "planning only", "resources.inter_node_bandwidth_gbps": "planning only",
    "fault_tolerance.relayout_on_resize": "becomes JobConfig.relayout_spec (the spec as JSON) when true",
}
# Only the worker configs have these: set by the code, not by a user.
ONLY_CONFIG = {
    "model.init_method_std": "Megatron's init std, fixed at 0.02",
    "training.adam_beta1": "AdamW's betas and eps: Megatron's defaults, not yet in the spec",
    "training.adam_beta2": "as adam_beta1", "training.adam_eps": "as adam_beta1",
    "checkpoint.resume_from": "chosen by the controller for each attempt",
}
# Computed from other fields by to_job_config: the spec's default means "derive it".
DERIVED = {
    "model.num_query_groups": "None: the number of heads",
    "model.ffn_hidden_size": "None: 4 x hidden_size",
    "model.kv_channels": "hidden_size / heads is stored as None",
    "parallel.expert_tensor_parallel_size": "None: the tensor parallel size",
    "training.data": "a blend's weights become strings",
}
# The spec side may also say "auto"; the search resolves it before a config is made.
AUTO = "auto"

PAIRS = [("model", spec.ModelSpec, config.ModelConfig), ("parallel", spec.ParallelSpec, config.ParallelConfig),
         ("training", spec.TrainingSpec, config.TrainingConfig), ("checkpoint", spec.CheckpointSpec,
                                                                   config.CheckpointConfig)]
# Sections the JobConfig holds flat.
FLAT = [("resources", spec.ResourcesSpec), ("fault_tolerance", spec.FaultToleranceSpec)]
JOB_ONLY = {"name", "model", "parallel", "training", "checkpoint", "world_size", "relayout_spec",
            "memory_upto"}


def kinds(annotation) -> frozenset:
    """A type as a set of plain kinds: ``Literal["a", "b"]`` is str, ``Annotated[int, ...]`` int, a
    list or a variadic tuple of X ``("seq", X)``, ``Literal["auto"]`` the marker ``"auto"``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return kinds(args[0])
    if origin in (typing.Union, types.UnionType):
        return frozenset().union(*(kinds(a) for a in args))
    if origin is typing.Literal:
        return frozenset(AUTO if a == AUTO else type(a).__name__ for a in args)
    if origin in (list, tuple):
        return frozenset({("seq", kinds(args[0]))})
    if annotation is type(None):
        return frozenset({"None"})
    return frozenset({annotation.__name__})


def sides(section: str, model: type[BaseModel], cls) -> dict[str, tuple]:
    """Each field either side declares: (spec type, spec default, config type, config default)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for name in set(model.model_fields) | ({n for n in fields if n not in JOB_ONLY} if cls is not config.JobConfig
                                           else set()):
        s = model.model_fields.get(name)
        c = fields.get(name)
        out[f"{section}.{name}"] = (
            kinds(s.annotation) - {AUTO} if s else None, s.default if s else None,
            kinds(hints[name]) if c else None,
            (c.default if c.default is not dataclasses.MISSING else "required") if c else None)
    return out


def disagreements(section: str, model: type[BaseModel], cls) -> list[str]:
    out = []
    for path, (s_type, s_default, c_type, c_default) in sorted(sides(section, model, cls).items()):
        if s_type is None or c_type is None:
            listed = ONLY_CONFIG if s_type is None else ONLY_SPEC
            if path not in listed:
                out.append(f"{path}: only in {'workers/config.py' if s_type is None else 'the spec'}")
            continue
        if path in DERIVED:
            continue
        if s_type != c_type:
            out.append(f"{path}: type {sorted(map(str, s_type))} in the spec, {sorted(map(str, c_type))} in the config")
        if s_default != c_default:
            out.append(f"{path}: default {s_default!r} in the spec, {c_default!r} in the config")
    return out


@pytest.mark.parametrize("section,model,cls", PAIRS + [(s, m, config.JobConfig) for s, m in FLAT],
                         ids=[p[0] for p in PAIRS] + [s for s, _ in FLAT])
def test_each_field_has_one_name_type_and_default(section, model, cls):
    assert disagreements(section, model, cls) == []


def test_the_lists_name_real_fields():
    every = {}
    for section, model, cls in PAIRS + [(s, m, config.JobConfig) for s, m in FLAT]:
        every.update(sides(section, model, cls))
    assert [p for p in {**ONLY_SPEC, **ONLY_CONFIG, **DERIVED} if p not in every] == []


def test_a_default_changed_on_one_side_is_caught(monkeypatch):
    field = next(f for f in dataclasses.fields(config.ModelConfig) if f.name == "norm_epsilon")
    monkeypatch.setattr(field, "default", 1e-6)
    assert disagreements("model", spec.ModelSpec, config.ModelConfig) == [
        "model.norm_epsilon: default 1e-05 in the spec, 1e-06 in the config"]


def test_every_shared_field_is_copied_by_name():
    """A spec whose every shared field differs from its default reaches the config unchanged."""
    data = {"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "norm_epsilon": 1e-6,
                      "rotary_base": 5e5, "moe_layer_freq": [1, 1], "num_moe_experts": 4, "qk_layernorm": True},
            "parallel": {"overlap_param_gather": True, "use_distributed_optimizer": True, "cp_comm_type": "all_gather"},
            "training": {"train_iters": 7, "lr_decay_style": "cosine", "clip_grad": 0.5, "eval_iters": 3,
                         "global_batch_size": 8, "micro_batch_size": 1},
            "checkpoint": {"keep_last": 5, "async_save": True},
            "resources": {"num_nodes": 1, "gpus_per_node": 1}}
    job = to_job_config(parse_spec(data))
    for section, values in data.items():
        target = job if section == "resources" else getattr(job, section)
        for name, value in values.items():
            assert getattr(target, name) == (tuple(value) if isinstance(value, list) else value), f"{section}.{name}"
