"""Hugging Face copies of a job's checkpoints as it trains (``checkpoint.save_hf``).

Rank 0, once a checkpoint is committed, writes every ``save_hf_interval``-th one and the job's last
one as a Hugging Face model directory (``config.json``, ``model.safetensors``) under
``checkpoint.dir/hf/iter_N``, with the exporter of ``raytron export --format hf``, in a background
thread: training goes on while it reads the committed files. The next save waits for it, so no
checkpoint is pruned while it is being read. The copies are not pruned with the checkpoints.
"""

from __future__ import annotations

import os
import threading

from workers.checkpoint.storage import checkpoint_name


class HFCopies:
    """Rank 0's background HF copies of the committed checkpoints.

    Args:
        root: the checkpoint root (a local directory).
        interval: copy every this many committed checkpoints.
        last_iteration: the iteration of the job's last checkpoint, which is always copied.
    """

    def __init__(self, root: str, interval: int, last_iteration: int):
        self.root, self.interval, self.last_iteration = root, interval, last_iteration
        self._commits = 0
        self._thread: threading.Thread | None = None
        self._done: list[dict] = []
        self._error: BaseException | None = None

    def committed(self, iteration: int) -> None:
        """A checkpoint of ``iteration`` was committed: copy it if it is due."""
        self._commits += 1
        if self._commits % self.interval and iteration != self.last_iteration:
            return
        self.wait()
        self._thread = threading.Thread(target=self._copy, args=(iteration,), daemon=True)
        self._thread.start()

    def _copy(self, iteration: int) -> None:
        from workers.hf.export import export_hf

        name = checkpoint_name(iteration)
        try:
            out = export_hf(os.path.join(self.root, name), os.path.join(self.root, "hf", name))
            self._done.append(out)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the copy in progress is written; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def take_done(self) -> list[dict]:
        """The copies written since the last call: ``export_hf``'s ``{"iteration", "architecture", "bytes", "path"}``."""
        done, self._done = self._done, []
        return done
