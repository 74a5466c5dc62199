"""daemon/loader/gguf_reader.py against gguf-py (the oracle): the same metadata and tensor bytes on
real files, and a clear GGUFError, never a crash or a huge allocation, on damaged ones."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.gguf_reader import GGUFError, read_gguf


def nbytes(ggml_type: int, dims: tuple[int, ...]) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    return int(np.prod(dims[1:])) * dims[0] // block * size


def test_demo_model_reads_as_gguf_py_reads_it() -> None:
    ours = read_gguf(DEMO_MODEL, nbytes)
    theirs = gguf.GGUFReader(DEMO_MODEL)
    assert ours.metadata == {f.name: f.contents() for f in theirs.fields.values()}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.ggml_type == int(b.tensor_type) and a.dims == tuple(int(d) for d in b.shape)
        assert a.data.tobytes() == np.asarray(b.data).tobytes() and not a.data.flags.writeable


def test_every_value_type(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    values = {"u8": (7, gguf.GGUFValueType.UINT8), "i8": (-7, gguf.GGUFValueType.INT8),
              "u16": (700, gguf.GGUFValueType.UINT16), "i16": (-700, gguf.GGUFValueType.INT16),
              "u32": (70000, gguf.GGUFValueType.UINT32), "i32": (-70000, gguf.GGUFValueType.INT32),
              "u64": (1 << 40, gguf.GGUFValueType.UINT64), "i64": (-(1 << 40), gguf.GGUFValueType.INT64),
              "f32": (0.5, gguf.GGUFValueType.FLOAT32), "f64": (0.25, gguf.GGUFValueType.FLOAT64),
              "bool": (True, gguf.GGUFValueType.BOOL), "str": ("héllo", gguf.GGUFValueType.STRING)}
    for key, (value, vtype) in values.items():
        writer.add_key_value(f"t.{key}", value, vtype)
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strings", ["a", "", "ü" * 3])
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_gguf(path, nbytes)
    assert ours.metadata == {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()}
    assert ours.metadata["t.strings"] == ["a", "", "üüü"] and ours.metadata["t.u64"] == 1 << 40
    np.testing.assert_array_equal(ours.tensors[0].data.view(np.float32), np.arange(64, dtype=np.float32))


def header(*parts: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + b"".join(parts)


def key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def strings(*values: bytes) -> bytes:
    return b"".join(struct.pack("<Q", len(v)) + v for v in values)


@pytest.mark.parametrize("data,reason", [
    (b"GGML" + bytes(40), "bad magic"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "version 1"),
    (header(struct.pack("<Q", 1 << 60)), "truncated"),  # a key length beyond the file
    (header(key("k"), struct.pack("<IIQ", 9, 8, 1 << 50)), "runs past"),  # 2^50 strings announced
    (header(key("k"), struct.pack("<IIQ", 9, 6, 1 << 60)), "runs past"),  # 2^60 floats announced
    (header(key("k"), struct.pack("<I", 99)), "unknown metadata value type"),
    (header(key("k"), struct.pack("<I", 8), struct.pack("<Q", 2), b"\xff\xfe"), "not UTF-8"),
    (header(key("k"), struct.pack("<IIQ", 9, 8, 2), strings(b"ok", b"\xff")), "string at offset 67 is not UTF-8"),
    # each half of "é" alone is no UTF-8, though the two back to back are
    (header(key("k"), struct.pack("<IIQ", 9, 8, 2), strings(b"a\xc3", b"\xa9b")), "string at offset 57 is not"),
    (header(key("k"), struct.pack("<IIQ", 9, 8, 2), strings(b"ok"), struct.pack("<Q", 1 << 40)), "truncated"),
], ids=["magic", "version", "key-length", "string-count", "array-count", "value-type", "utf8", "utf8-in-array",
        "utf8-split-char", "array-string-length"])
def test_damaged_headers_fail_clearly(tmp_path: Path, data: bytes, reason: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data + bytes(64))
    with pytest.raises(GGUFError, match=reason):
        read_gguf(path, nbytes)
