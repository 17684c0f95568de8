"""The packed-document switches of the training section (Megatron's ``reset_position_ids``,
``reset_attention_mask``, ``eod_mask_loss``, ``calculate_per_token_loss``): the combinations refused."""

from __future__ import annotations


def document_problems(t, vocab_size: int, mtp_num_layers: int | None = None) -> list[str]:
    """Packed-document switches that do not go together, each naming the fields and the fix."""
    out = []
    packed = [name for name in ("reset_position_ids", "reset_attention_mask", "calculate_per_token_loss")
              if getattr(t, name)]
    if packed and mtp_num_layers:
        out.append(f"model.mtp_num_layers with training.{packed[0]}: multi-token prediction does not shift its "
                   f"targets inside packed documents yet; drop one of them")
    if t.eod_token_id is not None and t.eod_token_id >= vocab_size:
        out.append(f"training.eod_token_id {t.eod_token_id} is not a token id of model.vocab_size {vocab_size}; "
                   f"use the tokenizer's end-of-document id")
    masked = [name for name in ("reset_attention_mask", "eod_mask_loss") if getattr(t, name)]
    if masked and not t.calculate_per_token_loss:
        out.append(f"training.{masked[0]} masks tokens out of the loss, which needs "
                   f"training.calculate_per_token_loss: true (the mean over loss tokens); set it")
    if t.eod_mask_loss and t.eod_token_id is None:
        out.append("training.eod_mask_loss needs training.eod_token_id (the end-of-document token id); set it")
    uses_eod = t.reset_position_ids or t.reset_attention_mask
    if uses_eod and t.eod_token_id is None and isinstance(t.data, str) and t.data.startswith("builtin:"):
        out.append(f"training.reset_position_ids / reset_attention_mask find documents by training.eod_token_id in "
                   f"{t.data} (it has no document index); set eod_token_id")
    return out
