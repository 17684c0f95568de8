"""Megatron-Core's distributed-optimizer state in a ``torch_dist`` checkpoint: which stored keys hold
Adam's moments and the fp32 main params of each model tensor (import), and the same state and common
entries written for megatron-core's ``DistributedOptimizer`` to load (export).

Megatron-Core keeps the state of model tensor ``KEY`` in its ``fully_reshardable`` format (Megatron-LM's
``--dist-ckpt-optim-fully-reshardable``, and the format of its non-distributed optimizers) under
``optimizer.state.exp_avg.KEY``, ``optimizer.state.exp_avg_sq.KEY`` and ``optimizer.state.param.KEY``
(``fp32_param`` in older files): tensors of KEY's own shape and sharding, so any layout reads its own
slices of them as of the weights. Adam's step is in the common state, in each of the optimizer's
``param_groups``. The ``dp_reshardable`` format (Megatron-LM's default; ``optimizer.distributed.*``:
Megatron's flat grad buckets of one tp x pp layout) and ``fully_sharded_model_space`` (a flattened
reformulation whose shape depends on the saving layout; the default of megatron-core's
``DistributedOptimizer.sharded_state_dict``, whose 0.19 save refuses it: "ShardedTensor.flattened_range
is not supported") are not read: the job starts a fresh optimizer, and the reader says why
(:func:`optimizer_source`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# raytron's optimizer-state kind -> megatron-core's names of it (the first present is read)
KINDS = {"exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",), "master": ("param", "fp32_param")}
FORMAT = "fully_reshardable"


@dataclass
class OptimizerSource:
    """What a Megatron-Core checkpoint gives raytron's optimizer.

    Attributes:
        keys: ``{kind: {model key: stored key}}`` for exp_avg, exp_avg_sq and master (empty: none read).
        step: Adam's step (the updates made), or None.
        note: one line for the job's events: what is read, or why the optimizer starts fresh.
    """

    keys: dict[str, dict[str, str]] = field(default_factory=dict)
    step: int | None = None
    note: str = ""


def _find(obj, name: str, depth: int = 0) -> list:
    """Every value under key ``name`` in nested dicts/lists (a few levels)."""
    if depth > 6:
        return []
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += [v] if k == name else _find(v, name, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _find(v, name, depth + 1)
    return out


def optimizer_source(tensors: dict[str, tuple], model_keys: set[str], common: dict, split: set[str]) -> OptimizerSource:
    """Where the optimizer state of ``model_keys`` is among the stored ``tensors`` (key -> shape).

    ``split``: stacked expert keys stored one key per expert (``...experts.experts.E.linear_fc1.weight``).
    """
    optimizer = common.get("optimizer")
    kind = next(iter(_find(optimizer, "param_state_sharding_type")), None)
    steps = [int(s) for groups in _find(optimizer, "param_groups") if isinstance(groups, list)
             for g in groups if isinstance(g, dict) and g.get("step") is not None for s in [g["step"]]]
    keys: dict[str, dict[str, str]] = {}
    for ours, names in KINDS.items():
        for name in names:
            found = {}
            for key in model_keys:
                stored = f"optimizer.state.{name}.{key}"
                probe = stored.replace(".experts.experts.", ".experts.experts.0.") if key in split else stored
                want = tensors[key][1:] if key in split else tensors[key]
                if tensors.get(probe) == want:
                    found[key] = stored
            if len(found) == len(model_keys):
                keys[ours] = found
                break
    if "exp_avg" in keys and "exp_avg_sq" in keys:
        step = max(steps) if steps else int(common.get("iteration") or 0)
        return OptimizerSource(keys, step, f"weights and optimizer state ({kind or FORMAT}: Adam's moments"
                                           f"{' and fp32 main params' if 'master' in keys else ''}, step {step})")
    if any(k.startswith(("optimizer.", "chained_")) for k in tensors) or kind:
        why = (f"its distributed-optimizer state is {kind or 'in another format'}, which raytron does not read "
               f"(it reads fully_reshardable: save with --dist-ckpt-optim-fully-reshardable)")
    else:
        why = "it holds no optimizer state"
    return OptimizerSource(note=f"weights only: a fresh optimizer from iteration 0; {why}")


def param_groups(training: dict, step: int) -> list[dict]:
    """megatron-core's two default param groups (decayed, and norms/biases without decay) of raytron
    training fields ``training``, at Adam step ``step``, as Megatron-LM's LR scheduler leaves them
    (``weight_decay`` times ``wd_mult``): what megatron-core's ``load_state_dict`` takes for its own groups."""
    lr = float(training.get("lr", 1e-3))
    base = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0, "is_decoupled_lr": False,
            "max_lr": lr, "min_lr": float(training.get("min_lr", 0.0)), "lr": lr,
            "betas": (float(training.get("adam_beta1", 0.9)), float(training.get("adam_beta2", 0.999))),
            "eps": float(training.get("adam_eps", 1e-8)), "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
            "step": float(step)}
    wd = float(training.get("weight_decay", 0.0))
    return [{**base, "wd_mult": 1.0, "weight_decay": wd}, {**base, "wd_mult": 0.0, "weight_decay": 0.0}]


def optimizer_common(training: dict, step: int) -> dict:
    """The optimizer's common (non-tensor) state as megatron-core's DistributedOptimizer keeps it."""
    return {"optimizer": {"param_groups": param_groups(training, step)}, "param_state_sharding_type": FORMAT}
