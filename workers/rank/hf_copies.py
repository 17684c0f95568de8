"""Hugging Face and Megatron-Core copies of a job's checkpoints as it trains (``checkpoint.save_hf``,
``checkpoint.save_format: megatron``).

Rank 0, once a checkpoint is committed, writes every ``save_hf_interval``-th one and the job's last
one as a Hugging Face model directory (``config.json``, ``model.safetensors``) under
``checkpoint.dir/hf/iter_N``, with the exporter of ``raytron export --format hf``, and (save_format
megatron) every one as a Megatron-Core torch_dist checkpoint under the Megatron-LM ``--save`` root
``checkpoint.dir/megatron``, with the exporter of ``raytron export --format megatron``, in a background
thread: training goes on while it reads the committed files. Under an object-store ``checkpoint.dir``
(``s3://``) the copies go to the same store, at the same place under it. The next save waits for it, so no
checkpoint is pruned while it is being read. The copies are not pruned with the checkpoints.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from workers.checkpoint.background import Background
from workers.checkpoint.storage import checkpoint_name


class HFCopies:
    """Rank 0's background HF copies of the committed checkpoints.

    Args:
        root: the checkpoint root (a local directory, or a URI of the store the checkpoints are in).
        interval: copy every this many committed checkpoints.
        last_iteration: the iteration of the job's last checkpoint, which is always copied.
        tokenizer: a directory whose tokenizer files each copy also gets.
        hf: write the HF copies (``save_hf``).
        megatron: write a Megatron-Core copy of every committed checkpoint.
    """

    def __init__(self, root: str, interval: int, last_iteration: int, tokenizer: str | None = None, *,
                 hf: bool = True, megatron: bool = False):
        self.root, self.interval, self.last_iteration = root, interval, last_iteration
        self.tokenizer, self.hf, self.megatron = tokenizer, hf, megatron
        self._commits = 0
        self._background = Background()
        self._done: list[dict] = []

    def committed(self, iteration: int) -> None:
        """A checkpoint of ``iteration`` was committed: copy it if it is due."""
        self._commits += 1
        hf = self.hf and (self._commits % self.interval == 0 or iteration == self.last_iteration)
        if hf or self.megatron:
            self._background.start(self._copy, iteration, hf)

    def _copy(self, iteration: int, hf: bool) -> None:
        from workers.checkpoint.megatron_export import export_megatron
        from workers.checkpoint.storage import Storage, list_checkpoints
        from workers.hf.export import export_hf

        name, root = checkpoint_name(iteration), Storage.from_uri(self.root)
        if root.is_local:
            self._export(export_hf, export_megatron, os.path.join(self.root, name), self.root, name, hf)
            return
        # an object store: the committed checkpoint keeps its save's name; the copies are written in a
        # local scratch directory, then put into the store file by file (rank 0 alone writes them)
        source = next(c.storage.uri for c in reversed(list_checkpoints(root)) if c.iteration == iteration)
        with tempfile.TemporaryDirectory(prefix="raytron-copies-") as scratch:
            done = self._export(export_hf, export_megatron, source, scratch, name, hf)
            for path in sorted(Path(scratch).rglob("*")):
                if path.is_file():
                    root.write(root.join(*path.relative_to(scratch).parts), [path.read_bytes()])
            for d in done:
                d["path"] = root.scheme + root.join(*Path(d["path"]).relative_to(scratch).parts)

    def _export(self, export_hf, export_megatron, source: str, out: str, name: str, hf: bool) -> list[dict]:
        """Write the copies of checkpoint ``source`` under ``out`` (``hf/NAME``, ``megatron``); returns them."""
        done = []
        if hf:
            done.append(export_hf(source, os.path.join(out, "hf", name), tokenizer=self.tokenizer))
        if self.megatron:
            done.append({**export_megatron(source, os.path.join(out, "megatron")), "format": "megatron"})
        self._done.extend(done)
        return done

    def wait(self) -> None:
        """Block until the copy in progress is written; re-raises its error."""
        self._background.wait()

    def take_done(self) -> list[dict]:
        """The copies written since the last call: ``export_hf``'s ``{"iteration", "architecture", "bytes", "path"}``,
        ``export_megatron``'s with ``"format": "megatron"``."""
        done, self._done = self._done, []
        return done
