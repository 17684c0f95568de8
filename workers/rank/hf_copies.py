"""Hugging Face copies of a job's checkpoints as it trains (``checkpoint.save_hf``).

Rank 0, once a checkpoint is committed, writes every ``save_hf_interval``-th one and the job's last
one as a Hugging Face model directory (``config.json``, ``model.safetensors``) under
``checkpoint.dir/hf/iter_N``, with the exporter of ``raytron export --format hf``, in a background
thread: training goes on while it reads the committed files. The next save waits for it, so no
checkpoint is pruned while it is being read. The copies are not pruned with the checkpoints.
"""

from __future__ import annotations

import os

from workers.checkpoint.background import Background
from workers.checkpoint.storage import checkpoint_name


class HFCopies:
    """Rank 0's background HF copies of the committed checkpoints.

    Args:
        root: the checkpoint root (a local directory).
        interval: copy every this many committed checkpoints.
        last_iteration: the iteration of the job's last checkpoint, which is always copied.
        tokenizer: a directory whose tokenizer files each copy also gets.
    """

    def __init__(self, root: str, interval: int, last_iteration: int, tokenizer: str | None = None):
        self.root, self.interval, self.last_iteration = root, interval, last_iteration
        self.tokenizer = tokenizer
        self._commits = 0
        self._background = Background()
        self._done: list[dict] = []

    def committed(self, iteration: int) -> None:
        """A checkpoint of ``iteration`` was committed: copy it if it is due."""
        self._commits += 1
        if self._commits % self.interval and iteration != self.last_iteration:
            return
        self._background.start(self._copy, iteration)

    def _copy(self, iteration: int) -> None:
        from workers.hf.export import export_hf

        name = checkpoint_name(iteration)
        self._done.append(export_hf(os.path.join(self.root, name), os.path.join(self.root, "hf", name),
                                    tokenizer=self.tokenizer))

    def wait(self) -> None:
        """Block until the copy in progress is written; re-raises its error."""
        self._background.wait()

    def take_done(self) -> list[dict]:
        """The copies written since the last call: ``export_hf``'s ``{"iteration", "architecture", "bytes", "path"}``."""
        done, self._done = self._done, []
        return done
