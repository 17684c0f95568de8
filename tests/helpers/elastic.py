"""A rank group that resumes from its checkpoints, for the elastic policy's tests."""

from __future__ import annotations

from service.control.errors import RankDied

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=256, seq_length=32)


class ResumingGroup:
    """Fake ranks of one attempt: resume at the last even iteration reached (a checkpoint every 2),
    loss 1/iteration, a node loss at a given iteration."""

    def __init__(self, world, reached, fail_at=None, on_fail=None):
        self.world, self.reached, self.fail_at, self.on_fail = world, reached, fail_at, on_fail

    def start(self, faults):
        self.it = self.reached[0] - self.reached[0] % 2
        return [{"rank": r, "node_id": f"n{r}", "pid": r, "resumed_iteration": self.it} for r in range(self.world)]

    def run(self, n):
        out = []
        for _ in range(n):
            if self.it + 1 == self.fail_at:
                self.on_fail()
                raise RankDied(self.world - 1, {"node": self.world - 1}, "actor died (its node is lost)")
            self.it += 1
            self.reached[0] = max(self.reached[0], self.it)
            out.append({"loss": 1.0 / self.it, "iteration": self.it})
        return [out] * self.world

    def shutdown(self, keep_warm=False):
        pass

    kill = shutdown
