"""``checkpoint.load: megatron:DIR`` checked before the job starts: the directory is a Megatron-Core
torch_dist checkpoint of a model raytron runs, and the spec's model is that model (each differing
field named, with both values)."""

from __future__ import annotations


def megatron_load_problems(c, m) -> list[str]:
    """What is wrong with ``checkpoint.load`` (``c``: the checkpoint section) being ``megatron:DIR`` for
    the spec's model ``m``; [] for any other ``load``."""
    if not c.load or not c.load.startswith("megatron:"):
        return []
    from workers.checkpoint.megatron_import import MegatronReader

    try:
        theirs = MegatronReader(c.load[len("megatron:"):]).model
    except ValueError as e:
        return [str(e)]
    h, heads = m.hidden_size, m.num_attention_heads
    defaults = {"num_query_groups": heads, "ffn_hidden_size": 4 * h, "kv_channels": h // heads}

    def effective(k: str, v):
        return defaults.get(k) if v is None else v

    diff = [f"model.{k}: {v!r} there, {getattr(m, k)!r} in the spec" for k, v in theirs.items()
            if hasattr(m, k) and effective(k, getattr(m, k)) != effective(k, v)]
    if not diff:
        return []
    return [f"checkpoint.load {c.load} holds another model ({'; '.join(diff)}); set those model fields to the "
            f"checkpoint's"]
