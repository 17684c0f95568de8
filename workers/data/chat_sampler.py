"""The sampler of a chat fine-tuning job (``training.chat_data``): iteration ``i``'s global batch is
packed rows ``[i * global_batch_size, (i + 1) * global_batch_size)`` of a
:class:`workers.data.chat.ChatDataset` (rows repeat, in the same seeded order, once the data is
used up), so every rank reads the same rows and a restart goes on at the next unseen one."""

from __future__ import annotations

from workers.data.chat import ChatDataset
from workers.data.packing import pack_rows


class ChatSampler:
    """:class:`workers.data.dataset.GlobalSampler`'s interface over chat data (batches are
    :class:`workers.data.packing.PackedBatch` es)."""

    def __init__(self, t, seq_length: int):
        self.data = ChatDataset(t.chat_data, t.chat_tokenizer, seq_length, t.seed, fmt=t.chat_format,
                                loss_on=t.chat_loss_on, overflow=t.chat_overflow)
        self.seed, self.global_batch_size, self.iteration = t.seed, t.global_batch_size, 0

    def batch(self, iteration: int, start: int = 0, count: int | None = None, split: str = "train"):
        if split != "train":
            raise ValueError("chat data has no validation split")
        count = self.global_batch_size - start if count is None else count
        base = iteration * self.global_batch_size + start
        return pack_rows([self.data.row(base + j) for j in range(count)])

    def batch_stats(self, iteration: int) -> dict:
        """What iteration ``iteration``'s global batch holds: ``loss_tokens``, ``packing_efficiency``
        (real tokens / slots) and ``loss_token_share`` (loss tokens / real tokens)."""
        rows = [(iteration * self.global_batch_size + j) % len(self.data) for j in range(self.global_batch_size)]
        real = sum(int(self.data.row_tokens[k]) for k in rows)
        loss = sum(float(self.data.row_loss_tokens[k]) for k in rows)
        return {"loss_tokens": loss, "packing_efficiency": real / (len(rows) * self.data.seq_length),
                "loss_token_share": loss / max(real, 1)}

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "seed": self.seed, "rows": len(self.data)}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint data seed {state['seed']} differs from training.seed {self.seed}")
        if state.get("rows", len(self.data)) != len(self.data):
            raise ValueError(f"the checkpoint was trained on {state['rows']} packed rows of chat data, "
                             f"training.chat_data now packs into {len(self.data)}: the data changed")
        self.iteration = state["iteration"]
