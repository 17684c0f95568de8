"""DeepSeek-V3's multi-token-prediction tensors in a Hugging Face directory.

DeepSeek-V3 stores MTP module ``k`` as one more layer after the last, ``model.layers.{N + k}``
(``N = num_hidden_layers``; ``num_nextn_predict_layers`` of them): the usual layer keys
(``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) plus

=====================================  ==============================================
raytron logical tensor                 Hugging Face (``model.layers.{N + k}.``)
=====================================  ==============================================
mtp.layers.k.enorm.weight              enorm.weight
mtp.layers.k.hnorm.weight              hnorm.weight
mtp.layers.k.eh_proj.weight [h, 2h]    eh_proj.weight
mtp.layers.k.final_norm.weight         shared_head.norm.weight
mtp.layers.k.layer.X                   X as layer N + k's (the layer keys)
(embedding.weight)                     embed_tokens.weight (a copy, written on export)
(output.weight)                        shared_head.head.weight (a copy, written on export)
=====================================  ==============================================

transformers' DeepseekV3ForCausalLM ignores these keys; inference engines read them as the
speculative-decoding head. raytron shares the embedding and output layer with the main model, so
the copies are written and not read back. Only DeepSeek-V3 has the keys: another family's export
leaves the MTP modules out (the main model is complete without them) and says so.
"""

from __future__ import annotations

from pathlib import Path

OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "final_norm.weight": "shared_head.norm.weight"}


def mtp_own_shapes(m: dict, k: int) -> dict[str, tuple[int, ...]]:
    """MTP module ``k``'s tensors other than its layer's."""
    h = m["hidden_size"]
    return {f"mtp.layers.{k}.{name}": (h, 2 * h) if name == "eh_proj.weight" else (h,) for name in OWN}


def as_layer_name(name: str, m: dict) -> str | None:
    """``mtp.layers.k.layer.X`` as the decoder-layer name ``layers.{N + k}.X`` (None for another name)."""
    if not name.startswith("mtp.layers."):
        return None
    _, _, k, rest = name.split(".", 3)
    return f"layers.{m['num_layers'] + int(k)}.{rest[len('layer.'):]}" if rest.startswith("layer.") else None


def mtp_own_to_hf(name: str, t, m: dict) -> dict:
    """An MTP module's own tensor (:func:`mtp_own_shapes`) under its DeepSeek-V3 name."""
    _, _, k, rest = name.split(".", 3)
    return {f"model.layers.{m['num_layers'] + int(k)}.{OWN[rest]}": t}


def shared_copies(name: str, t, m: dict) -> dict:
    """The per-module copies of the shared embedding and output layer DeepSeek-V3 stores."""
    key = {"embedding.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}.get(name)
    if key is None or not m.get("mtp_num_layers"):
        return {}
    return {f"model.layers.{m['num_layers'] + k}.{key}": t for k in range(m["mtp_num_layers"])}


def mtp_layers_in(files: dict[str, Path], config: dict) -> int | None:
    """How many MTP modules a DeepSeek-V3 directory holds weights of (None: none): its
    ``num_nextn_predict_layers`` when the first one's ``eh_proj`` is there (transformers'
    ``save_pretrained`` keeps the count in config.json but drops the weights)."""
    n, layers = config.get("num_nextn_predict_layers") or 0, config.get("num_hidden_layers")
    return n if n and f"model.layers.{layers}.eh_proj.weight" in files else None
