"""Tensor storage types ember reads (the GGML type ids of GGUF) and their block geometry.

A quantized row is a sequence of blocks; each block covers `block_size` values in `type_size` bytes.
Ids equal ggml's `enum ggml_type`, so a GGUF tensor's type field is used as it is.
"""
from __future__ import annotations

from enum import IntEnum


class TensorType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30


QK_K = 256  # values per K-quant super-block
QK = 32  # values per block of the 32-value types (Q4_0 ... Q8_0, IQ4_NL)

# type -> (values per block, bytes per block)
BLOCK_GEOMETRY: dict[TensorType, tuple[int, int]] = {
    TensorType.F32: (1, 4),
    TensorType.F16: (1, 2),
    TensorType.BF16: (1, 2),
    TensorType.Q4_0: (QK, 2 + QK // 2),
    TensorType.Q4_1: (QK, 2 + 2 + QK // 2),
    TensorType.Q5_0: (QK, 2 + 4 + QK // 2),
    TensorType.Q5_1: (QK, 2 + 2 + 4 + QK // 2),
    TensorType.Q8_0: (QK, 2 + QK),
    TensorType.IQ4_NL: (QK, 2 + QK // 2),
    TensorType.Q2_K: (QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    TensorType.Q3_K: (QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    TensorType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    TensorType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    TensorType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    TensorType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
}
# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl): a 4-bit code indexes this table
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class UnsupportedTensorType(ValueError):
    """A tensor is stored in a type ember has no kernel for."""


def tensor_type(type_id: int) -> TensorType:
    try:
        return TensorType(type_id)
    except ValueError:
        raise UnsupportedTensorType(f"unsupported tensor type id {type_id}") from None


def row_bytes(ttype: TensorType, cols: int) -> int:
    """Bytes of one row of `cols` values; raises if cols is not a whole number of blocks."""
    block, size = BLOCK_GEOMETRY[ttype]
    if cols % block:
        raise UnsupportedTensorType(f"{ttype.name} row of {cols} values is not a multiple of {block}")
    return cols // block * size
