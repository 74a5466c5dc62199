"""A GGUF parser of ember's own: the header, the metadata and the tensor table, read from the mmap'd
file in one pass; tensors are zero-copy numpy views of it.

gguf-py's GGUFReader builds a numpy memmap view per field part (several per string): on a 32000-token
vocabulary that took 1.0-1.7 s, nearly all of a warm load, while llama.cpp opens the same file in
0.1 s. Here a string is one slice of the mapped bytes, an array of strings one packed StringTable (as
str objects a vocabulary takes ~7x the memory, for the model's lifetime), a numeric array one
np.frombuffer, and every count and length is checked against the bytes that remain before anything is
allocated, so a truncated or hostile header fails with GGUFError instead of exhausting memory.
Layout (little-endian, versions 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata as (string key, u32 type, value); tensor infos as (string name, u32 dims, u64 dims
(ggml order), u32 type, u64 offset); tensor data from the next multiple of general.alignment
(default 32).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .string_table import StringTable

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

# value type -> (struct format, numpy dtype) for scalars; 8 STRING and 9 ARRAY are handled apart
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "|b1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a GGUF file ember can read, or its header is damaged."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml order: the row length first
    data: np.ndarray  # uint8 view of the tensor's bytes in the mapped file (read-only)


@dataclass(frozen=True)
class GGUFContents:
    version: int
    metadata: dict[str, Any]  # scalars as Python values, arrays as lists (of strings: a StringTable)
    tensors: list[TensorInfo]


def read_gguf(path: str | Path, tensor_bytes: Any) -> GGUFContents:
    """Parse `path`. tensor_bytes(ggml_type, dims) gives a tensor's size in bytes (None for a type
    the caller does not know, whose data is then left empty for the caller to refuse)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFError(f"truncated header ({size} bytes)")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _Parser(mapped, tensor_bytes).parse()


def _all_utf8(blob: bytes, ends: np.ndarray) -> bool:
    """Whether each of the strings that end at `ends` in `blob` is UTF-8: the whole is, and no string
    starts on a continuation byte (10xxxxxx), i.e. inside a character the one before began."""
    try:
        blob.decode()
    except UnicodeDecodeError:
        return False
    starts = ends[:-1][ends[:-1] < len(blob)]
    return not np.any(np.frombuffer(blob, np.uint8)[starts] & 0xC0 == 0x80)


class _Parser:
    def __init__(self, buf: mmap.mmap, tensor_bytes: Any) -> None:
        self.buf, self.pos, self.tensor_bytes = buf, 0, tensor_bytes
        self.view = memoryview(buf)

    # --- primitives ---------------------------------------------------------------------------------
    def _take(self, n: int) -> int:
        """Reserve n bytes at the cursor; returns where they start."""
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"truncated header: {n} bytes wanted at offset {self.pos} of {len(self.buf)}")
        start = self.pos
        self.pos += n
        return start

    def _scalar(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self._take(width))[0]

    def _string(self) -> str:
        n = self._scalar("<Q")
        return self._decoded(self._take(n), n)

    def _strings(self, count: int) -> StringTable:
        """`count` strings back to back, packed. Each length says where the next string starts, so that
        walk is a loop; the copy and the UTF-8 check run over all of them at once."""
        buf, size, pos, first = self.buf, len(self.buf), self.pos, self.pos
        starts, lengths = [0] * count, [0] * count
        for i in range(count):
            if pos + 8 > size:
                raise GGUFError(f"truncated header: a string length wanted at offset {pos} of {size}")
            n = _U64.unpack_from(buf, pos)[0]
            pos += 8
            if n > size - pos:
                raise GGUFError(f"truncated header: {n} bytes wanted at offset {pos} of {size}")
            starts[i], lengths[i] = pos, n
            pos += n
        self.pos = pos
        region = np.frombuffer(buf, np.uint8, pos - first, first)
        keep = np.ones(len(region), bool)
        keep[(np.array(starts, np.int64) - (first + 8))[:, None] + np.arange(8)] = False  # the length fields
        blob, ends = region[keep].tobytes(), np.cumsum(lengths, dtype=np.int64)
        if not _all_utf8(blob, ends):
            for start, n in zip(starts, lengths):  # which one, for the message
                self._decoded(start, n)
        return StringTable(blob, ends)

    def _decoded(self, start: int, n: int) -> str:
        try:
            return str(self.view[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"a string at offset {start} is not UTF-8 ({e.reason})") from None

    def _count(self, count: int, min_bytes: int) -> int:
        if count * min_bytes > len(self.buf) - self.pos:
            raise GGUFError(f"a count of {count} at offset {self.pos} runs past the end of the file")
        return count

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._scalar("<I"), self._scalar("<Q")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1])
                start = self._take(self._count(count, dtype.itemsize) * dtype.itemsize)
                return np.frombuffer(self.buf, dtype, count, start).tolist()
            if etype == _STRING:
                return self._strings(self._count(count, 8))
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(self._count(count, 12))]
            raise GGUFError(f"unknown array element type {etype} at offset {self.pos}")
        raise GGUFError(f"unknown metadata value type {vtype} at offset {self.pos}")

    # --- the file -----------------------------------------------------------------------------------
    def parse(self) -> GGUFContents:
        if self.buf[:4] != MAGIC:
            raise GGUFError("not a GGUF file (bad magic)")
        self.pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(self._count(n_kv, 12)):
            key = self._string()
            metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(self._count(n_tensors, 24))]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-self.pos // alignment) * alignment
        whole = np.frombuffer(self.buf, np.uint8)
        tensors = []
        for name, dims, ggml_type, offset in infos:
            nbytes = self.tensor_bytes(ggml_type, dims)
            start = data_start + offset
            end = start if nbytes is None else min(start + nbytes, len(self.buf))  # short: the caller reports it
            tensors.append(TensorInfo(name, ggml_type, dims, whole[min(start, len(self.buf)) : end]))
        return GGUFContents(version, metadata, tensors)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        dims = tuple(self._scalar("<Q") for _ in range(n_dims))
        if any(d == 0 or d > 1 << 40 for d in dims):
            raise GGUFError(f"tensor {name} has impossible dimensions {dims}")
        return name, dims, self._scalar("<I"), self._scalar("<Q")
