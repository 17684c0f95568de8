"""W&B offline runs read back: the records of a run's ``.wandb`` file, parsed by wandb's own protobuf
(``wandb.proto.wandb_internal_pb2.Record``), as ``wandb sync`` reads them.

wandb 0.2x/0.3x has no Python reader of its own (the reader is in its Go core), so the file's framing
is read here: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of records, each
with a 7-byte header (CRC-32 of type byte and data, little-endian length, type FULL/FIRST/MIDDLE/LAST),
a block's tail of fewer than 7 bytes left as zeros: the LevelDB log format. Every record's CRC is
checked; a record still being written ends the reading.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """The ``Record`` messages of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a .wandb file"
    out, pos, parts = [], 7, []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail: padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # being written: the records so far
            break
        body = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + body) == crc, f"{path}: bad CRC at byte {pos}"
        pos += 7 + length
        parts.append(body)
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def run_dirs(root: Path) -> list[Path]:
    """The offline run directories under a ``dir`` (its ``wandb`` directory)."""
    return sorted(p for p in (Path(root) / "wandb").glob("offline-run-*") if p.is_dir())


def read_run(run_dir: Path) -> dict:
    """A run directory's id, config, history (``{step: {key: value}}``), summary and exit code."""
    (file,) = Path(run_dir).glob("run-*.wandb")
    run = {"id": None, "config": {}, "history": {}, "summary": {}, "exit_code": None}
    for record in records(file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = record.history.step.num if record.history.HasField("step") else row.get("_step")
            run["history"].setdefault(step, {}).update(row)
        elif kind == "summary":
            run["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in record.summary.update})
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run
