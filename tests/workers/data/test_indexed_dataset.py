"""Megatron's .bin/.idx format: read a dataset the test writes byte by byte, and write the same bytes."""

import struct

import numpy as np
import pytest

from workers.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype, write_indexed_dataset

# Megatron's DType enum (megatron/core/datasets/indexed_dataset.py), written out here.
CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
STRUCT = {"uint8": "B", "int8": "b", "int16": "h", "int32": "i", "int64": "q", "float64": "d", "float32": "f",
          "uint16": "H"}

# Three documents; the second is sentence-split into two sequences, the third is empty
# (Megatron's encoder gives an empty document no sequence at all).
DOCS = [[[5, 6, 7, 2]], [[9, 1], [3, 3, 4, 2]], []]


def megatron_bytes(docs, dtype_name):
    """(.bin, .idx) bytes as Megatron's IndexedDatasetBuilder + _IndexWriter produce them."""
    fmt = STRUCT[dtype_name]
    size = struct.calcsize(fmt)
    data, lengths, doc_index = b"", [], [0]
    for doc in docs:
        for seq in doc:
            data += struct.pack(f"<{len(seq)}{fmt}", *seq)
            lengths.append(len(seq))
        doc_index.append(len(lengths))
    pointers, ptr = [], 0
    for n in lengths:
        pointers.append(ptr)
        ptr += n * size
    idx = b"MMIDIDX\x00\x00"
    idx += struct.pack("<Q", 1)  # version
    idx += struct.pack("<B", CODES[dtype_name])
    idx += struct.pack("<Q", len(lengths))  # sequence count
    idx += struct.pack("<Q", len(doc_index))  # document count: index entries, documents + 1
    idx += b"".join(struct.pack("<i", n) for n in lengths)
    idx += b"".join(struct.pack("<q", p) for p in pointers)
    idx += b"".join(struct.pack("<q", d) for d in doc_index)
    return data, idx


@pytest.mark.parametrize("dtype_name", ["uint16", "int32", "int64", "uint8", "int16"])
def test_reads_megatron_bytes_and_writes_the_same(tmp_path, dtype_name):
    data, idx = megatron_bytes(DOCS, dtype_name)
    (tmp_path / "m.bin").write_bytes(data)
    (tmp_path / "m.idx").write_bytes(idx)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.dtype(dtype_name)
    assert len(ds) == 3 and ds.num_documents == 3 and ds.document_count == 4
    assert ds.sequence_lengths.tolist() == [4, 2, 4]
    size = np.dtype(dtype_name).itemsize
    assert ds.sequence_pointers.tolist() == [0, 4 * size, 6 * size]
    assert ds.document_indices.tolist() == [0, 1, 3, 3]
    assert [ds[i].tolist() for i in range(3)] == [[5, 6, 7, 2], [9, 1], [3, 3, 4, 2]]
    assert ds.document(1).tolist() == [9, 1, 3, 3, 4, 2] and ds.document(2).tolist() == []
    assert ds.tokens.tolist() == [5, 6, 7, 2, 9, 1, 3, 3, 4, 2] and ds.num_tokens == 10
    assert ds.token_range(1, 3) == (4, 10)

    with IndexedDatasetWriter(tmp_path / "w", dtype=dtype_name) as w:
        for doc in DOCS:
            w.add_document([t for seq in doc for t in seq], [len(seq) for seq in doc])
    assert (tmp_path / "w.bin").read_bytes() == data
    assert (tmp_path / "w.idx").read_bytes() == idx

    with IndexedDatasetWriter(tmp_path / "items", dtype=dtype_name) as w:  # add_item/end_document
        for doc in DOCS:
            for seq in doc:
                w.add_item(seq)
            w.end_document()
    assert (tmp_path / "items.idx").read_bytes() == idx


def test_write_indexed_dataset_one_sequence_per_document(tmp_path):
    docs = [[1, 2, 3], [], [70000, 5]]  # an empty document gets no sequence, as Megatron's encoder gives
    write_indexed_dataset(tmp_path / "d", docs, dtype=np.int32)
    data, idx = megatron_bytes([[d] if d else [] for d in docs], "int32")
    assert (tmp_path / "d.idx").read_bytes() == idx and (tmp_path / "d.bin").read_bytes() == data


def test_optimal_dtype_is_megatrons():
    assert optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32
    assert optimal_dtype(None) is np.int32


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([1, 2])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_bad_files_are_refused(tmp_path):
    data, idx = megatron_bytes(DOCS, "uint16")
    with pytest.raises(ValueError, match="does not exist"):
        IndexedDataset(tmp_path / "none")
    (tmp_path / "a.bin").write_bytes(data)
    (tmp_path / "a.idx").write_bytes(b"NOTMMIDX" + idx[8:])
    with pytest.raises(ValueError, match="bad magic header"):
        IndexedDataset(tmp_path / "a")
    (tmp_path / "a.idx").write_bytes(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    with pytest.raises(ValueError, match="version 2"):
        IndexedDataset(tmp_path / "a")
    (tmp_path / "a.idx").write_bytes(idx[:17] + struct.pack("<B", 9) + idx[18:])
    with pytest.raises(ValueError, match="unknown dtype code 9"):
        IndexedDataset(tmp_path / "a")
    (tmp_path / "a.idx").write_bytes(idx[:-8])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(tmp_path / "a")
    (tmp_path / "a.idx").write_bytes(idx)
    (tmp_path / "a.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="a.bin is truncated"):
        IndexedDataset(tmp_path / "a")
