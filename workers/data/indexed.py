"""Megatron's indexed dataset: a ``PREFIX.bin`` of token ids and its ``PREFIX.idx`` index.

The layout is exactly what ``megatron/core/datasets/indexed_dataset.py`` writes
(``_IndexWriter``), all little-endian::

    .idx  b"MMIDIDX\\x00\\x00"        9 bytes, magic
          version                     uint64 = 1
          dtype code                  uint8  (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                              6 float64, 7 float32, 8 uint16)
          sequence count S            uint64
          document count D            uint64 (document index entries, so documents + 1)
          sequence lengths            int32[S]   tokens per sequence
          sequence pointers           int64[S]   byte offset of each sequence in .bin
          document index              int64[D]   0, then the sequence count after each document
          (sequence modes             int8[S]    multimodal datasets only; ignored here)
    .bin  the sequences' tokens back to back, in the dtype above

A "sequence" is a document (or a sentence, with ``--split-sentences``). Both files are
memory-mapped: opening a dataset of any size costs the index, not the tokens.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8


def dtype_code(dtype) -> int:
    """Megatron's ``DType.code_from_dtype``."""
    dtype = np.dtype(dtype)
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == dtype:
            return code
    raise ValueError(f"dtype {dtype} cannot be stored in a Megatron indexed dataset; "
                     f"use one of {sorted(np.dtype(t).name for t in DTYPE_CODES.values())}")


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's ``DType.optimal_dtype``: uint16 below 65500 ids, int32 otherwise."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


def is_indexed_dataset(prefix: str | os.PathLike) -> bool:
    """Whether ``PREFIX.idx`` and ``PREFIX.bin`` both exist."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """A read-only, memory-mapped Megatron indexed dataset.

    Args:
        prefix: the path without ``.bin`` / ``.idx``.

    Raises:
        ValueError: a file is missing, or the index is not Megatron's format, or the ``.bin``
            is shorter than the index says.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx, binf = idx_path(prefix), bin_path(prefix)
        for path in (idx, binf):
            if not os.path.isfile(path):
                raise ValueError(f"indexed dataset {self.prefix!r}: {path} does not exist "
                                 f"(a Megatron dataset is a PREFIX.bin + PREFIX.idx pair; "
                                 f"`raytron preprocess` writes one)")
        with open(idx, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[:9] != INDEX_HEADER:
            raise ValueError(f"{idx} is not a Megatron indexed-dataset index (bad magic header)")
        version, code, self.sequence_count, self.document_count = struct.unpack("<QBQQ", head[9:])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx}: index version {version}, only version {INDEX_VERSION} is known")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        s, d = self.sequence_count, self.document_count
        need = _HEADER_BYTES + 12 * s + 8 * d
        size = os.path.getsize(idx)
        if size < need:
            raise ValueError(f"{idx} is truncated: {size} bytes, the header announces {s} sequences and "
                             f"{d} document-index entries ({need} bytes)")
        buf = np.memmap(idx, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=s, offset=_HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=s, offset=_HEADER_BYTES + 4 * s)
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=_HEADER_BYTES + 12 * s)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = os.path.getsize(binf)
        if bin_size < self.num_tokens * self.dtype.itemsize:
            raise ValueError(f"{binf} is truncated: {bin_size} bytes, the index describes {self.num_tokens} "
                             f"{self.dtype.name} tokens ({self.num_tokens * self.dtype.itemsize} bytes)")
        # np.memmap refuses an empty file; an empty dataset has no tokens to map.
        self.tokens = (np.memmap(binf, mode="r", dtype=self.dtype.newbyteorder("<"), shape=(self.num_tokens,))
                       if self.num_tokens else np.zeros(0, dtype=self.dtype))

    def __len__(self) -> int:
        """The number of sequences."""
        return self.sequence_count

    @property
    def num_documents(self) -> int:
        return max(self.document_count - 1, 0)

    def __getitem__(self, index: int) -> np.ndarray:
        """Sequence ``index`` as a read-only view of the ``.bin``."""
        if not -self.sequence_count <= index < self.sequence_count:
            raise IndexError(f"sequence {index} out of range for {self.sequence_count} sequences")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[index])]

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index`` (all its sequences)."""
        first, last = int(self.document_indices[index]), int(self.document_indices[index + 1])
        start, stop = self.token_range(first, last)
        return self.tokens[start:stop]

    def token_range(self, seq_begin: int, seq_end: int) -> tuple[int, int]:
        """Token offsets ``[start, stop)`` of sequences ``[seq_begin, seq_end)`` in :attr:`tokens`."""
        if seq_begin >= seq_end:
            return 0, 0
        start = int(self.sequence_pointers[seq_begin]) // self.dtype.itemsize
        last = seq_end - 1
        stop = int(self.sequence_pointers[last]) // self.dtype.itemsize + int(self.sequence_lengths[last])
        return start, stop


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin`` / ``PREFIX.idx`` as Megatron's ``IndexedDatasetBuilder`` does.

    Files are written under temporary names and renamed by :meth:`finalize`, so a failed run
    leaves no half-written dataset. Use as a context manager, or call :meth:`finalize`.

    Args:
        prefix: output path without extension.
        dtype: the token dtype (Megatron's default: int32; preprocess picks :func:`optimal_dtype`).
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = bin_path(prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """Append one sequence; close its document with :meth:`end_document`."""
        arr = np.asarray(tokens).astype(self.dtype.newbyteorder("<"), copy=False).reshape(-1)
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """Append a whole document; ``lengths`` splits it into sequences (default: one)."""
        arr = np.asarray(tokens).astype(self.dtype.newbyteorder("<"), copy=False).reshape(-1)
        if lengths is None:  # one sequence; an empty document has none (as Megatron's encoder gives)
            lengths = [arr.size] if arr.size else []
        lengths = list(lengths)
        if sum(lengths) != arr.size:
            raise ValueError(f"sequence lengths sum to {sum(lengths)}, the document has {arr.size} tokens")
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        idx_tmp = idx_path(self.prefix) + ".tmp"
        with open(idx_tmp, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<QBQQ", INDEX_VERSION, self._code, len(lengths), len(self.document_indices)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self.document_indices, dtype="<i8").tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Drop what was written."""
        self._bin.close()
        for path in (self._bin_tmp, idx_path(self.prefix) + ".tmp"):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed_dataset(prefix: str | os.PathLike, documents, dtype=np.int32) -> None:
    """Write ``documents`` (each a sequence of token ids) as one-sequence documents."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
