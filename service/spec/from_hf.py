"""``model.from_hf``: the architecture fields a Hugging Face directory's config.json gives a spec,
and the fields a spec gives that disagree with it."""

from __future__ import annotations

from workers.hf.families import model_from_hf_config, read_hf_config


def hf_model_fields(directory: str) -> dict:
    """The ModelSpec architecture fields of a Hugging Face directory's config.json (all but
    seq_length: max_position_embeddings is not the training sequence length), MoE routing, MLA
    and YaRN fields included (Qwen3-MoE, DeepSeek-V3: :mod:`workers.hf.families`)."""
    config = read_hf_config(directory, "model.from_hf")
    try:
        hf = model_from_hf_config(config)
    except KeyError as e:
        raise ValueError(f"model.from_hf {directory}: config.json has no {e.args[0]}; it is not a decoder config "
                         f"raytron reads") from None
    except ValueError as e:
        raise ValueError(f"model.from_hf {directory}: {e}") from None
    hf.pop("seq_length")
    return hf


def from_hf_problems(m) -> list[str]:
    """``model.from_hf`` unreadable, or a field the spec gives that disagrees with it (None fields
    compared as what they default to), each naming the field, both values and the fix."""
    if m.from_hf is None:
        return []
    try:
        hf = hf_model_fields(m.from_hf)
    except ValueError as e:
        return [str(e)]
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    defaults = {"num_query_groups": heads, "ffn_hidden_size": 4 * h, "kv_channels": h // heads}

    def effective(k: str, v):
        return defaults.get(k) if v is None else v

    return [f"model.{k}: {getattr(m, k)!r} in the spec, {v!r} in model.from_hf {m.from_hf}/config.json; remove "
            f"model.{k} (from_hf fills it) or make it agree" for k, v in hf.items()
            if effective(k, getattr(m, k)) != effective(k, v)]
