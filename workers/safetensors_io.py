"""The safetensors file format, written and read without the ``safetensors`` package.

The format is small and fixed (an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}`` and ``__metadata__``, then the raw little-endian
data), so raytron's export needs no extra runtime dependency; the tests check the files
against the real package and ``transformers``. Reading takes one tensor at a time with a
seek, so a rank importing a large model never holds more than the tensor it needs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_NAMES = {v: k for k, v in DTYPES.items()}


def save_file(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` as one safetensors file; returns its size in bytes."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        blobs.append(t)
        offset += nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in blobs:
            if t.numel():
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
    return 8 + len(raw) + offset


class SafetensorsFile:
    """The header of one safetensors file, and its tensors on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20:
                raise ValueError(f"{self.path}: a {length}-byte header; this is not a safetensors file")
            header = json.loads(f.read(length))
        self.metadata = header.pop("__metadata__", {})
        self.header, self.data_start = header, 8 + length

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            raw = bytearray(f.read(end - begin))
        dtype = DTYPES[entry["dtype"]]
        if not raw:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype).view(entry["shape"])


class SafetensorsDir:
    """Every tensor of a model directory: one ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json``."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {f: SafetensorsFile(directory / f) for f in sorted(set(weight_map.values()))}
            self._where = {name: files[f] for name, f in weight_map.items()}
        else:
            paths = sorted(directory.glob("*.safetensors"))
            if not paths:
                raise ValueError(f"{directory} has no *.safetensors files; save the model with "
                                 f"save_pretrained(..., safe_serialization=True)")
            self._where = {name: f for f in map(SafetensorsFile, paths) for name in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get(name)
