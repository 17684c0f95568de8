"""A job controller with a scripted rank group in place of real ranks."""

from __future__ import annotations

from service.control.errors import RankDied

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=256, seq_length=32)


class FakeGroup:
    """Ranks that return a loss per iteration, or fail at a given call."""

    def __init__(self, world: int, fail_on_call: int | None = None, loss=None):
        self.world, self.fail_on_call, self.calls, self.shut = world, fail_on_call, 0, False
        self.faults = None
        self.loss = loss or (lambda call: 1.0 / call)

    def start(self, faults):
        self.faults = list(faults)
        return [{"rank": r, "node_id": f"n{r // 2}", "pid": 100 + r, "tp": r % 2, "pp": 0, "dp": r // 2, "cp": 0,
                 "ep": 0} for r in range(self.world)]

    def run(self, iterations):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RankDied(1, {"node": 0, "node_id": "n0", "pid": 101}, "actor died")
        return [[{"loss": self.loss(self.calls), "iteration": self.calls}] * iterations for _ in range(self.world)]

    def shutdown(self, keep_warm=False):
        self.shut = True

    def kill(self):
        pass
