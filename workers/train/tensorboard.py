"""TensorBoard scalars (``training.tensorboard_dir``) with Megatron's names, no extra dependency.

``tensorboard`` (and so ``torch.utils.tensorboard``) is not installed with raytron: it pulls
in grpcio, protobuf and a web server. A scalar event file is simple enough to write here: a
TFRecord file (per record: little-endian u64 length, masked CRC-32C of it, the bytes, masked
CRC-32C of them) of ``Event`` protobufs (``wall_time`` = 1, ``step`` = 2, ``file_version`` = 3,
``summary`` = 5 holding ``Value { tag = 1, simple_value = 2 }``). TensorBoard reads the
files this writes like those of ``SummaryWriter``.

As in Megatron, the last rank (it holds the loss) writes; the tags are Megatron's
(``training.py`` ``training_log`` and ``evaluate_and_print_results``).
"""

from __future__ import annotations

import os
import socket
import struct
import time

TAGS = {  # train_step metric -> Megatron's TensorBoard tag
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "loss_scale": "loss-scale",
    "moe_aux_loss": "load_balancing_loss",
    "mtp_loss": "mtp loss",
    "loss_tokens": "loss-tokens-per-step",
    "packing_efficiency": "packing-efficiency",
    "val_loss": "lm loss validation",
    "step_time_s": "iteration-time",
    "tokens_per_s": "throughput-tokens-per-sec",
    "peak_mem_mb": "mem-max-allocated-mb",
    "skipped": "skipped-iterations",
}


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def event(wall_time: float, step: int, *, tag: str | None = None, value: float | None = None,
          file_version: str | None = None) -> bytes:
    """One serialised ``Event``: a scalar summary, or the file-version header."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if tag is not None:
        val = _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", value))
        out += _bytes_field(5, _bytes_field(1, val))
    return out


def record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


class EventWriter:
    """Appends scalar events to one ``events.out.tfevents.*`` file under ``logdir``."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.raytron"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "ab")
        self._file.write(record(event(time.time(), 0, file_version="brain.Event:2")))
        self._file.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._file.write(record(event(time.time(), step, tag=tag, value=float(value))))

    def write_metrics(self, metrics: dict) -> None:
        """Every numeric metric of one ``train_step`` under its Megatron tag, at its iteration."""
        for key, tag in TAGS.items():
            value = metrics.get(key)
            if value is not None:
                self.add_scalar(tag, value, metrics["iteration"])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_scalars(path: str) -> list[tuple[int, str, float]]:
    """``(step, tag, value)`` of every scalar in an event file, checking every CRC (for tests
    and debugging; TensorBoard itself reads the files in production)."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[pos + 8 : pos + 12])[0] != masked_crc(header):
            raise ValueError(f"{path}: bad length CRC at byte {pos}")
        body = data[pos + 12 : pos + 12 + length]
        if struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] != masked_crc(body):
            raise ValueError(f"{path}: bad data CRC at byte {pos}")
        pos += 16 + length
        fields = dict(_parse(body))
        if 5 in fields:
            step = fields.get(2, 0)
            value = dict(_parse(dict(_parse(fields[5]))[1]))
            out.append((step, value[1].decode(), struct.unpack("<f", value[2])[0]))
    return out


def _parse(buf: bytes):
    """Yield ``(field number, value)`` of a protobuf message (varint, 64-bit, bytes, 32-bit)."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, pos
