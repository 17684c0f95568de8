"""``checkpoint.load: megatron:DIR`` and ``checkpoint.save_format: megatron`` checked before the job
starts: the directory is a Megatron-Core torch_dist checkpoint of a model raytron runs, and the spec's
model is that model (each differing field named, with both values); the copies are written of a dense
model, next to the checkpoints (a local directory or an object store)."""

from __future__ import annotations


def megatron_save_problems(c, m) -> list[str]:
    """What is wrong with ``checkpoint.save_format: megatron`` (``c``: the checkpoint section) for model ``m``."""
    if c.save_format != "megatron":
        return []
    if not c.save_interval:
        return ["checkpoint.save_format megatron needs checkpoint.save_interval (it copies the checkpoints the job saves)"]
    moe = [k for k in ("num_moe_experts", "multi_latent_attention", "mtp_num_layers") if getattr(m, k, None)]
    if moe:
        return [f"checkpoint.save_format megatron writes dense GPT/Llama models; this model has "
                f"{', '.join(f'model.{k}' for k in moe)}: drop save_format or use save_hf"]
    return []


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


def source_optimizer_note(source: str | None) -> tuple[bool, str]:
    """``(fresh, note)`` of a job's checkpoint source for its STARTING event: ``hf:DIR`` holds weights
    only; ``megatron:DIR`` holds Adam's state where it is in a format raytron reads (the note says which,
    or why the optimizer starts fresh); a raytron checkpoint resumes everything (``(False, "")``)."""
    if not source or not source.startswith(("hf:", "megatron:")):
        return False, ""
    if source.startswith("megatron:"):
        from workers.checkpoint.megatron_import import MegatronReader

        try:
            optim = MegatronReader(source[len("megatron:"):]).optim
            return not optim.keys, optim.note
        except ValueError:
            pass  # the ranks say what is wrong with it
    return True, "weights only: a fresh optimizer from iteration 0"
