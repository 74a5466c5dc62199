"""Weights repacked at load for the native GPU kernels: the same bits as the file, laid out so that a lane
of a warp reads 32 values with 16-byte loads and finds their scales apart (kernels/cuda/native/weights.cuh
reads this layout; its comment and `Repacked` below describe it).

A ggml block interleaves its scales with its quants (34 bytes for Q8_0, 210 for Q6_K), so no quant run
is 16-byte aligned; and a Q4_K byte holds values 32 apart. Here every unit of 32 values is one aligned
run of quants: Q8_0's 32 int8, or 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31 (Q4_K,
Q5_K, and Q6_K's low four bits). High bits and scales sit in arrays of their own. Nothing is rounded:
`dequantize` of the repacked arrays equals gguf's dequantization of the file's blocks bit for bit, which
the tests check for every type.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ember.kernels.convert import bf16_bits_to_f32, f16_bits_to_f32
from ember.kernels.reference.quant import _nibbles_q4_k, unpack_scale_min_k4
from ember.kernels.tensor_types import BLOCK_GEOMETRY, QK_K, TensorType

UNIT = 32  # values one lane reads at a time
NATIVE_TYPES = (TensorType.F16, TensorType.BF16, TensorType.Q8_0, TensorType.Q4_K, TensorType.Q5_K, TensorType.Q6_K)


@dataclass(frozen=True)
class Repacked:
    """One weight [rows, cols] in the native kernels' layout; arrays a type does not use are empty.

    F16/BF16: q  uint16 [rows, cols] bits
    Q8_0:     q  int8 [rows, cols];   sc uint16 [rows, cols/32] f16 scales
    Q4_K:     q  uint8 [rows, cols/2] (unit u: bytes 16u..16u+15, byte i = value i | value 16+i << 4);
              sc uint8 [rows, cols/256 * 16], each super-block's 16-byte head (d, dmin, 12 scale bytes)
    Q5_K:     as Q4_K, and hi uint32 [rows, cols/32]: bit i = bit 4 of the unit's value i
    Q6_K:     q  as Q4_K, the low 4 bits;  hi uint8 [rows, cols/4] (unit u: bytes 8u..8u+7, byte k bits
              2f..2f+1 = the high 2 bits of value 4k+f);  sc int8 [rows, cols/16];  d uint16 [rows, cols/256]
    """
    ttype: TensorType
    rows: int
    cols: int
    q: np.ndarray
    hi: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    sc: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    d: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.q, self.hi, self.sc, self.d

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def repack(ttype: TensorType, data: np.ndarray, rows: int, cols: int) -> Repacked:
    """The file's storage of a [rows, cols] weight (kernels/reference/quant.py's convention) repacked."""
    ttype = TensorType(ttype)
    if ttype not in NATIVE_TYPES:
        raise ValueError(f"no native GPU layout for {ttype.name}")
    if cols % (QK_K if ttype in (TensorType.Q4_K, TensorType.Q5_K, TensorType.Q6_K) else UNIT):
        raise ValueError(f"{ttype.name}: a row of {cols} values is not a whole number of native units")
    if ttype in (TensorType.F16, TensorType.BF16):
        return Repacked(ttype, rows, cols, np.ascontiguousarray(np.asarray(data).view(np.uint16).reshape(rows, cols)))
    blocks = np.asarray(data, np.uint8).reshape(rows, -1, BLOCK_GEOMETRY[ttype][1])
    if ttype == TensorType.Q8_0:
        return Repacked(ttype, rows, cols, np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols),
                        sc=np.ascontiguousarray(blocks[..., :2]).view(np.uint16).reshape(rows, cols // UNIT))
    flat = blocks.reshape(-1, blocks.shape[-1])
    if ttype == TensorType.Q6_K:
        low, high = _q6_k_values(flat)
        return Repacked(ttype, rows, cols, _pack_nibbles(low, rows), hi=_pack_pairs(high, rows),
                        sc=np.ascontiguousarray(flat[:, 192:208]).view(np.int8).reshape(rows, cols // 16),
                        d=np.ascontiguousarray(flat[:, 208:210]).view(np.uint16).reshape(rows, cols // QK_K))
    head = np.ascontiguousarray(flat[:, :16]).reshape(rows, -1)
    qs = flat[:, 16:144] if ttype == TensorType.Q4_K else flat[:, 48:176]
    nibbles = _nibbles_q4_k(qs).reshape(-1, QK_K)
    if ttype == TensorType.Q4_K:
        return Repacked(ttype, rows, cols, _pack_nibbles(nibbles, rows), sc=head)
    high = ((flat[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, QK_K)
    bits = (high.reshape(-1, UNIT).astype(np.uint32) << np.arange(UNIT, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return Repacked(ttype, rows, cols, _pack_nibbles(nibbles, rows), hi=bits.reshape(rows, -1), sc=head)


def _q6_k_values(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks [n, 210] -> (low 4 bits, high 2 bits), each uint8 [n, 256] in value order."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (ql & 15).reshape(n, QK_K), (qh & 3).reshape(n, QK_K)


def _pack_nibbles(values: np.ndarray, rows: int) -> np.ndarray:
    """4-bit values in value order [.., 256] -> per unit, byte i = value i | value 16+i << 4."""
    units = values.reshape(-1, 2, 16)
    return (units[:, 0] | (units[:, 1] << 4)).astype(np.uint8).reshape(rows, -1)


def _pack_pairs(values: np.ndarray, rows: int) -> np.ndarray:
    """2-bit values in value order -> byte k of a unit = values 4k..4k+3, value 4k+f at bits 2f..2f+1."""
    quads = values.reshape(-1, 4).astype(np.uint8)
    return (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).reshape(rows, -1)


# --- the layout's own oracle -----------------------------------------------------------------------
def _unpack_nibbles(q: np.ndarray) -> np.ndarray:
    units = q.reshape(-1, 16)
    return np.concatenate([units & 15, units >> 4], axis=1).reshape(q.shape[0], -1)


def dequantize(w: Repacked) -> np.ndarray:
    """float32 [rows, cols] from the repacked arrays, in gguf's float32 operation order."""
    rows, cols = w.rows, w.cols
    if w.ttype == TensorType.F16:
        return f16_bits_to_f32(w.q)
    if w.ttype == TensorType.BF16:
        return bf16_bits_to_f32(w.q)
    if w.ttype == TensorType.Q8_0:
        d = f16_bits_to_f32(w.sc).reshape(rows, -1, 1)
        return (d * w.q.reshape(rows, -1, UNIT).astype(np.float32)).reshape(rows, cols)
    q = _unpack_nibbles(w.q)
    if w.ttype == TensorType.Q6_K:
        quads = w.hi.reshape(-1, 1) >> np.array([0, 2, 4, 6], np.uint8)
        q = (q | ((quads & 3).reshape(rows, cols) << 4)).astype(np.int8) - np.int8(32)
        dsc = f16_bits_to_f32(w.d).reshape(rows, -1, 1) * w.sc.astype(np.float32).reshape(rows, -1, 16)
        return (dsc.reshape(rows, -1, 1) * q.reshape(rows, -1, 16).astype(np.float32)).reshape(rows, cols)
    if w.ttype == TensorType.Q5_K:
        bits = (w.hi.reshape(-1, 1) >> np.arange(UNIT, dtype=np.uint32)) & 1
        q = q | (bits.astype(np.uint8).reshape(rows, cols) << 4)
    head = w.sc.reshape(-1, 16)
    d, dmin = f16_bits_to_f32(head[:, 0:4].copy().view(np.uint16)).T
    sc, m = unpack_scale_min_k4(head[:, 4:16])
    dsc = (d[:, None] * sc.astype(np.float32)).reshape(rows, -1, 1)
    dm = (dmin[:, None] * m.astype(np.float32)).reshape(rows, -1, 1)
    return (dsc * q.reshape(rows, -1, UNIT).astype(np.float32) - dm).reshape(rows, cols)
