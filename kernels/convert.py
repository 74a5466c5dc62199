"""Row conversions between float32 and the storage dtypes of the precision policies: f32, f16, bf16
and q8_0. `encode_rows` turns float32 rows into storage, `decode_rows` turns storage back into float32,
and `storage_bytes` is the size of a row in storage — the one definition the memory planner uses.

Storage layouts (rows along the last axis, any leading shape):
  f32   float32 [..., n]
  f16   uint16 [..., n], IEEE half bit patterns (round to nearest even; beyond +-65504 becomes inf)
  bf16  uint16 [..., n], the top half of the float32 bits (round to nearest even; NaN stays NaN)
  q8_0  uint8 [..., ceil(n / 32) * 34], ggml's block_q8_0: an f16 scale d = max|x| / 127, then 32
        int8 values round(x / d), rounded half away from zero as ggml's reference does. A row whose
        length is not a multiple of 32 is zero-padded to whole blocks (the padding decodes to 0 and
        is dropped).
Plain numpy: conversions run on rows crossing a boundary (a device split, a feature mirror, a KV
write), never inside a matmul, so they are memory-bound and numpy is as fast as a kernel would be.
"""
from __future__ import annotations

import numpy as np

STORAGE_DTYPES = ("f32", "f16", "bf16", "q8_0")
QK8_0 = 32  # values per q8_0 block
Q8_0_BLOCK_BYTES = 2 + QK8_0  # f16 scale + 32 int8


def storage_bytes(dtype: str, n: int) -> int:
    """Bytes of one row of `n` values stored as `dtype` (q8_0: whole blocks of 34 bytes)."""
    if dtype == "f32":
        return 4 * n
    if dtype in ("f16", "bf16"):
        return 2 * n
    if dtype == "q8_0":
        return -(-n // QK8_0) * Q8_0_BLOCK_BYTES
    raise ValueError(f"unknown storage dtype {dtype!r} (choose from {', '.join(STORAGE_DTYPES)})")


def encode_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows [..., n] -> storage of `dtype` (layouts in the module docstring)."""
    x = np.ascontiguousarray(x, np.float32)
    if dtype == "f32":
        return x.copy()
    if dtype == "f16":
        return f32_to_f16_bits(x)
    if dtype == "bf16":
        return f32_to_bf16_bits(x)
    if dtype == "q8_0":
        return quantize_q8_0(x)
    raise ValueError(f"unknown storage dtype {dtype!r} (choose from {', '.join(STORAGE_DTYPES)})")


def decode_rows(data: np.ndarray, dtype: str, n: int) -> np.ndarray:
    """Storage of `dtype` -> float32 rows [..., n]; `n` is needed because q8_0 rows are padded."""
    if dtype == "f32":
        return np.ascontiguousarray(data, np.float32).copy()
    if dtype == "f16":
        return f16_bits_to_f32(data)
    if dtype == "bf16":
        return bf16_bits_to_f32(data)
    if dtype == "q8_0":
        return dequantize_q8_0(data, n)
    raise ValueError(f"unknown storage dtype {dtype!r} (choose from {', '.join(STORAGE_DTYPES)})")


# --- 16-bit floats ------------------------------------------------------------------------------
def f32_to_f16_bits(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # out of range becomes inf, as a cast on the device does
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def f16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch and ggml do; NaN is kept a (quiet) NaN, which the rounding
    trick alone would turn into infinity for NaNs whose payload sits in the low half."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), rounded).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# --- q8_0 ---------------------------------------------------------------------------------------
def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., ceil(n/32) * 34] in ggml's block_q8_0 layout, bit-exact with
    ggml's quantize_row_q8_0_ref (and gguf-py's Q8_0)."""
    x = np.ascontiguousarray(x, np.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    nb = -(-n // QK8_0)
    padded = np.zeros(lead + (nb * QK8_0,), np.float32)
    padded[..., :n] = x
    blocks = padded.reshape(-1, QK8_0)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = _round_half_away(blocks * inv).astype(np.int8)
    out = np.empty((blocks.shape[0], Q8_0_BLOCK_BYTES), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(lead + (nb * Q8_0_BLOCK_BYTES,))


def dequantize_q8_0(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [..., ceil(n/32) * 34] block_q8_0 rows -> float32 [..., n]."""
    data = np.ascontiguousarray(data, np.uint8)
    nb = -(-n // QK8_0)
    if data.shape[-1] != nb * Q8_0_BLOCK_BYTES:
        raise ValueError(f"q8_0 rows of {n} values take {nb * Q8_0_BLOCK_BYTES} bytes, got {data.shape[-1]}")
    lead = data.shape[:-1]
    blocks = data.reshape(-1, Q8_0_BLOCK_BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    values = blocks[:, 2:].view(np.int8).astype(np.float32) * d
    return values.reshape(lead + (nb * QK8_0,))[..., :n].copy()


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf, as ggml's reference quantizer uses (np.rint would round half to even)."""
    a = np.abs(v)
    floored = np.floor(a)
    return np.sign(v) * (floored + np.floor(2 * (a - floored)))
