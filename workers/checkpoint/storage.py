"""Checkpoint directories on any filesystem ``pyarrow.fs`` reaches, committed atomically.

``checkpoint.dir`` is a local path or a URI (``file://``, ``s3://``, ``gs://``, ...), opened
with ``pyarrow.fs.FileSystem.from_uri`` as Ray Train's storage layer does, so ranks on nodes
without a shared filesystem can still write one checkpoint together.

One checkpoint is one directory, ``iter_0000010``. Ranks write into a temporary sibling,
``.iter_0000010.tmp-<nonce>`` (the nonce is new for every save, so files a crashed earlier
attempt left behind can never be mistaken for this save's); every file is fsynced (local
filesystems) once closed. The commit is two steps: ``manifest.json``, which names every file
with its size and CRC-32, is written last, then the directory is renamed to its final name.
On object stores, where a directory cannot be renamed atomically, the manifest alone is the
commit and the directory keeps its temporary name: discovery (:func:`list_checkpoints`) trusts a directory only when its manifest parses
and every file it lists is there with its size, whatever the directory is called. A crash at
any point before the manifest leaves a directory discovery ignores, and never touches an
earlier checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import zlib
from dataclasses import dataclass
from typing import Iterable

import pyarrow.fs as pafs

MANIFEST = "manifest.json"
FORMAT = "raytron-checkpoint"
VERSION = 1
_FINAL = re.compile(r"^iter_(\d+)$")
_TMP = re.compile(r"^\.iter_(\d+)\.tmp-[0-9a-f]+$")


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def crc32(data, value: int = 0) -> int:
    """Running CRC-32 (zlib's) of bytes-like ``data``; chain calls through ``value``."""
    return zlib.crc32(data, value) & 0xFFFFFFFF


@dataclass(frozen=True)
class Storage:
    """A filesystem and a base path on it (the checkpoint root or one checkpoint)."""

    fs: pafs.FileSystem
    root: str
    scheme: str = ""
    """The URI's ``scheme://`` and ``?query`` (e.g. ``endpoint_override``), kept so that :attr:`uri`
    opens the same place again; empty for a local path."""
    query: str = ""

    @property
    def uri(self) -> str:
        """What :meth:`from_uri` opens as this storage: the path, or ``scheme://root?query``."""
        return f"{self.scheme}{self.root}{self.query}" if self.scheme else self.root

    @classmethod
    def from_uri(cls, uri: str) -> "Storage":
        """A local path (relative paths are made absolute) or any URI pyarrow understands."""
        if "://" not in uri:
            return cls(pafs.LocalFileSystem(), os.path.abspath(uri))
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"checkpoint location {uri!r} is not a path or a URI pyarrow can open: {e}") from None
        scheme = uri.split("://", 1)[0] + "://"
        query = "?" + uri.split("?", 1)[1] if "?" in uri else ""
        if isinstance(fs, pafs.LocalFileSystem):
            scheme = query = ""  # file://: a plain path from here on
        return cls(fs, path.rstrip("/") or "/", scheme, query)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def sub(self, *parts: str) -> "Storage":
        return Storage(self.fs, self.join(*parts), self.scheme, self.query)

    def makedirs(self, path: str) -> None:
        self.fs.create_dir(path, recursive=True)

    def write(self, path: str, chunks: Iterable) -> tuple[int, int]:
        """Write bytes-like ``chunks`` to ``path`` durably; returns ``(size, crc32)``."""
        size, value = 0, 0
        with self.fs.open_output_stream(path) as out:
            for chunk in chunks:
                out.write(chunk)
                size += memoryview(chunk).nbytes
                value = crc32(chunk, value)
        self._fsync(path)
        return size, value

    def write_json(self, path: str, obj) -> tuple[int, int]:
        """Write ``obj`` as JSON; it appears under ``path`` only once whole (written under a
        temporary name, then moved), since others poll for it and read it at once."""
        size_crc = self.write(path + ".part", [json.dumps(obj, indent=1, sort_keys=True).encode()])
        self.fs.move(path + ".part", path)
        return size_crc

    def read(self, path: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        with self.fs.open_input_file(path) as f:
            if nbytes is None:
                nbytes = f.size() - offset
            return f.read_at(nbytes, offset)

    def read_json(self, path: str):
        return json.loads(self.read(path))

    def sizes(self, directory: str) -> dict[str, int]:
        """``{file name: size}`` of the files directly in ``directory`` (empty if it is missing)."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}

    def subdirs(self, directory: str) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def rename_dir(self, src: str, dst: str) -> str:
        """Move a finished directory to its final name; returns where it now is.

        Only on local filesystems, where ``rename`` is atomic. Object stores move a directory
        object by object (copy, delete): a crash halfway would leave two incomplete halves
        of a complete checkpoint, so there it stays where it is (its manifest made it
        complete already).
        """
        if not self.is_local:
            return src
        if os.path.exists(dst):
            self.fs.delete_dir(dst)  # an older save of the same iteration (an earlier attempt)
        os.rename(src, dst)
        self._fsync(os.path.dirname(dst))
        return dst

    def delete_dir(self, path: str) -> None:
        try:
            self.fs.delete_dir(path)
        except FileNotFoundError:
            pass

    def _fsync(self, path: str) -> None:
        # pyarrow's output streams expose no fsync; on a local disk reopen and sync, so a
        # power cut after the commit cannot leave a manifest that names unwritten data.
        if self.is_local:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass(frozen=True)
class CheckpointInfo:
    iteration: int
    storage: Storage  # the checkpoint directory itself
    manifest: dict


def read_manifest(ckpt: Storage) -> dict:
    """The manifest of one checkpoint directory, checked against the files present.

    Raises:
        ValueError: no manifest (an incomplete save), not a raytron checkpoint, or a listed
            file missing or of the wrong size.
    """
    sizes = ckpt.sizes(ckpt.root)
    if MANIFEST not in sizes:
        raise ValueError(f"{ckpt.root} has no {MANIFEST}: it is not a complete raytron checkpoint "
                         f"(a save that did not finish, or not a checkpoint directory)")
    try:
        manifest = ckpt.read_json(ckpt.join(MANIFEST))
    except ValueError as e:
        raise ValueError(f"{ckpt.join(MANIFEST)} is not valid JSON ({e}); the save did not finish") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{ckpt.root}: manifest format {manifest.get('format')!r} version "
                         f"{manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}")
    for name, entry in manifest["files"].items():
        if sizes.get(name) != entry["size"]:
            raise ValueError(f"{ckpt.join(name)}: size {sizes.get(name)} on disk, the manifest says "
                             f"{entry['size']}; the checkpoint is damaged, load an earlier one")
    return manifest


def list_checkpoints(root: Storage) -> list[CheckpointInfo]:
    """Every complete checkpoint under ``root``, oldest first; incomplete ones are skipped."""
    found = []
    for name in root.subdirs(root.root):
        if not (_FINAL.match(name) or _TMP.match(name)):
            continue
        ckpt = root.sub(name)
        try:
            manifest = read_manifest(ckpt)
        except (ValueError, OSError):
            continue
        found.append(CheckpointInfo(int(manifest["iteration"]), ckpt, manifest))
    return sorted(found, key=lambda c: (c.iteration, c.manifest.get("created_unix", 0)))


def latest_checkpoint(root: Storage) -> CheckpointInfo | None:
    """The complete checkpoint of the highest iteration under ``root``, or ``None``."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def metric_of(info: CheckpointInfo, name: str) -> float | None:
    """The checkpoint's value of metric ``name`` (``val_loss``, ``lm_loss``) as saved with it; None if
    it has none (no evaluation at that iteration) or it is not finite."""
    value = (info.manifest.get("metrics") or {}).get(name)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def retained(complete: list[CheckpointInfo], keep_last: int, keep_best: int = 0,
             best_metric: str = "val_loss") -> dict[int, str]:
    """Which of ``complete`` (oldest first) a root keeps, and why: the newest ``keep_last`` ("last"),
    and the ``keep_best`` with the lowest ``best_metric`` ("best val_loss 2.3412"), by iteration."""
    why = {c.iteration: ["last"] for c in complete[max(0, len(complete) - keep_last):]}
    scored = sorted((m, c.iteration) for c in complete if (m := metric_of(c, best_metric)) is not None)
    for value, iteration in scored[:keep_best]:
        why.setdefault(iteration, []).append(f"best {best_metric} {value:.6g}")
    return {iteration: " and ".join(reasons) for iteration, reasons in sorted(why.items())}


def prune(root: Storage, keep_last: int, committed: int, *, keep_best: int = 0,
          best_metric: str = "val_loss") -> list[str]:
    """Delete the complete checkpoints :func:`retained` does not keep and the leftovers of saves that
    never finished (temporary directories of iterations up to ``committed``).

    Returns the deleted directory names.
    """
    deleted = []
    complete = list_checkpoints(root)
    keep = retained(complete, keep_last, keep_best, best_metric)
    for info in complete:
        if info.iteration in keep:
            continue
        root.delete_dir(info.storage.root)
        deleted.append(os.path.basename(info.storage.root))
    kept = {c.storage.root for c in complete}
    for name in root.subdirs(root.root):
        m = _TMP.match(name) or _FINAL.match(name)
        if m and int(m.group(1)) <= committed and root.join(name) not in kept:
            root.delete_dir(root.join(name))
            deleted.append(name)
    return deleted


def wait_for_files(storage: Storage, directory: str, names: list[str], timeout_s: float,
                   poll_s: float = 0.02) -> dict[str, int]:
    """Poll until every file in ``names`` exists in ``directory``; returns all sizes there.

    This is how the committing rank learns that every rank has finished writing, without a
    collective: a background save thread must not issue collectives beside training's.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        sizes = storage.sizes(directory)
        missing = [n for n in names if n not in sizes]
        if not missing:
            return sizes
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {directory}: after {timeout_s:.0f}s still waiting for "
                               f"{len(missing)} rank files ({missing[:4]}...)")
        time.sleep(poll_s)
