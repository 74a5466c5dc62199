"""Quantized matmul and embedding on the GPU, reading every weight type as the file stores it.

A weight goes to the device once, as its file bytes (Q8_0, Q4_K, Q5_K, Q6_K blocks; F16/BF16 bits;
F32): no dequantized copy exists anywhere. One device function decodes block `b` of row `r` of any
format into float32 values, following the layouts of kernels/reference/quant.py (the oracle the tests
compare with); f16 and bf16 bits become floats through 65536-entry tables, since numba has no float16
on the simulator and a table is exact (the CPU kernels do the same).

The matmul gives each thread one output row and a tile of TILE tokens: the thread decodes each of the
row's blocks once and multiplies it into TILE accumulators, so a batch of tokens reads and decodes the
weight once per tile rather than once per token. There is no cross-thread reduction, so the kernel
is correct for any launch and cheap on the simulator; on a GPU its reads are not coalesced (a thread
walks its own row), which is issue 15's to fix with warp-per-row kernels and cuBLAS for prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32

from ember.kernels.convert import bf16_bits_to_f32, f16_bits_to_f32
from ember.kernels.cuda.device import flat_grid
from ember.kernels.cuda.device_array import DeviceArray, empty
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import BLOCK_GEOMETRY, TensorType

TILE = 4  # tokens a thread carries through one pass over its weight row
MAX_BLOCK = 256  # values of the widest block (a K-quant super-block)
FLOAT_BLOCK = 32  # F32/F16/BF16 rows are walked in chunks of this many values

# format codes the kernels branch on (numba freezes module-level ints into constants)
F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K = range(7)
_CODE = {TensorType.F32: F32, TensorType.F16: F16, TensorType.BF16: BF16, TensorType.Q8_0: Q8_0,
         TensorType.Q4_K: Q4_K, TensorType.Q5_K: Q5_K, TensorType.Q6_K: Q6_K}
_BLOCK_BYTES = {code: BLOCK_GEOMETRY[t][1] for t, code in _CODE.items()}
Q8_BYTES, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES = (_BLOCK_BYTES[c] for c in (Q8_0, Q4_K, Q5_K, Q6_K))

_ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@dataclass(frozen=True)
class Tables:
    """The f16 and bf16 decoding tables, on the device once per backend."""
    f16: Any
    bf16: Any

    @classmethod
    def upload(cls) -> Tables:
        return cls(cuda.to_device(f16_bits_to_f32(_ALL_BITS)), cuda.to_device(bf16_bits_to_f32(_ALL_BITS)))


@dataclass(frozen=True)
class CudaWeight:
    """A 2-D weight on the device in its file format. The arrays a format does not use are 1x1
    placeholders, so one compiled kernel serves every format."""
    ttype: TensorType
    rows: int
    cols: int
    u8: Any  # quantized: uint8 [rows, row bytes]
    i8: Any  # the same bytes as int8 (q8_0 values, q6_K scales)
    u16: Any  # F16 / BF16: uint16 [rows, cols] bits
    f32: Any  # F32: float32 [rows, cols]

    @property
    def code(self) -> int:
        return _CODE[self.ttype]

    @property
    def block_values(self) -> int:
        return FLOAT_BLOCK if self.code in (F32, F16, BF16) else BLOCK_GEOMETRY[self.ttype][0]

    @property
    def nbytes(self) -> int:
        return int(self.u8.nbytes + self.u16.nbytes + self.f32.nbytes)


def upload(t: RawTensor) -> CudaWeight:
    """The tensor's storage, copied to the device as it is (straight from the mmap'd file)."""
    if t.ttype not in _CODE:
        raise ValueError(f"{t.name}: no CUDA kernel for {t.ttype.name}")
    data = t.rows2d()
    tiny_u8 = cuda.to_device(np.zeros((1, 1), np.uint8))
    u8 = u16 = f32 = None
    if t.ttype == TensorType.F32:
        f32 = cuda.to_device(np.ascontiguousarray(data, np.float32))
    elif t.ttype in (TensorType.F16, TensorType.BF16):
        u16 = cuda.to_device(np.ascontiguousarray(data).view(np.uint16))
    else:
        u8 = cuda.to_device(np.ascontiguousarray(data, np.uint8))
    u8 = tiny_u8 if u8 is None else u8
    return CudaWeight(t.ttype, t.rows, t.cols, u8, u8.view(np.int8),
                      cuda.to_device(np.zeros((1, 1), np.uint16)) if u16 is None else u16,
                      cuda.to_device(np.zeros((1, 1), np.float32)) if f32 is None else f32)


# --- decoding one block --------------------------------------------------------------------------
@cuda.jit(device=True)
def _f16_at(u8, r, at, f16):  # type: ignore[no-untyped-def]
    return f16[int(u8[r, at]) | (int(u8[r, at + 1]) << 8)]


@cuda.jit(device=True)
def _scale_min_k4(u8, r, base, j):  # type: ignore[no-untyped-def]
    """ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 bytes at base."""
    if j < 4:
        return int(u8[r, base + j]) & 63, int(u8[r, base + j + 4]) & 63
    sc = (int(u8[r, base + j + 4]) & 15) | ((int(u8[r, base + j - 4]) >> 6) << 4)
    m = (int(u8[r, base + j + 4]) >> 4) | ((int(u8[r, base + j]) >> 6) << 4)
    return sc, m


@cuda.jit(device=True)
def decode_block(code, u8, i8, u16, f32, r, b, cols, f16, bf16, out):  # type: ignore[no-untyped-def]
    """Values of block b of row r into out[0:n]; returns n (a float format's last block may be short)."""
    if code == F32 or code == F16 or code == BF16:
        start = b * FLOAT_BLOCK
        n = min(FLOAT_BLOCK, cols - start)
        for j in range(n):
            if code == F32:
                out[j] = f32[r, start + j]
            elif code == F16:
                out[j] = f16[u16[r, start + j]]
            else:
                out[j] = bf16[u16[r, start + j]]
        return n
    if code == Q8_0:
        base = b * Q8_BYTES
        d = _f16_at(u8, r, base, f16)
        for j in range(32):
            out[j] = float32(i8[r, base + 2 + j]) * d
        return 32
    if code == Q6_K:
        base = b * Q6K_BYTES
        d = _f16_at(u8, r, base + 208, f16)
        for v in range(256):
            h, k, l = v // 128, (v % 128) // 32, v % 32
            low = (int(u8[r, base + 64 * h + 32 * (k & 1) + l]) >> (4 * (k >> 1))) & 15
            high = (int(u8[r, base + 128 + 32 * h + l]) >> (2 * k)) & 3
            scale = float32(i8[r, base + 192 + 8 * h + 2 * k + l // 16])
            out[v] = (d * scale) * float32((low | (high << 4)) - 32)
        return 256
    # Q4_K and Q5_K share the header: d, dmin, 12 bytes of packed 6-bit scales and mins
    size = Q4K_BYTES if code == Q4_K else Q5K_BYTES
    base = b * size
    d = _f16_at(u8, r, base, f16)
    dmin = _f16_at(u8, r, base + 2, f16)
    qs = base + 16 if code == Q4_K else base + 48
    for j in range(8):
        sc, m = _scale_min_k4(u8, r, base + 4, j)
        dsc, dm = d * float32(sc), dmin * float32(m)
        for l in range(32):
            q = (int(u8[r, qs + 32 * (j // 2) + l]) >> (4 * (j & 1))) & 15
            if code == Q5_K:
                q |= ((int(u8[r, base + 16 + l]) >> j) & 1) << 4
            out[32 * j + l] = dsc * float32(q) - dm
    return 256


# --- kernels -------------------------------------------------------------------------------------
@cuda.jit
def _matmul(x, code, u8, i8, u16, f32, rows, cols, nblocks, f16, bf16, out):  # type: ignore[no-untyped-def]
    # one task = (output row, tile of TILE tokens); x [n, cols] f32 -> out [n, rows]
    n = x.shape[0]
    tiles = (n + TILE - 1) // TILE
    vals = cuda.local.array(MAX_BLOCK, float32)
    acc = cuda.local.array(TILE, float32)
    for task in range(cuda.grid(1), rows * tiles, cuda.gridsize(1)):
        r, t0 = task % rows, (task // rows) * TILE
        width = min(TILE, n - t0)
        for t in range(TILE):
            acc[t] = float32(0)
        col = 0
        for b in range(nblocks):
            count = decode_block(code, u8, i8, u16, f32, r, b, cols, f16, bf16, vals)
            for j in range(count):
                w = vals[j]
                for t in range(width):
                    acc[t] += w * x[t0 + t, col + j]
            col += count
        for t in range(width):
            out[t0 + t, r] = acc[t]


@cuda.jit
def _embedding(ids, code, u8, i8, u16, f32, cols, nblocks, block_values, f16, bf16, out):  # type: ignore[no-untyped-def]
    # one task = (token, block of its row)
    vals = cuda.local.array(MAX_BLOCK, float32)
    for task in range(cuda.grid(1), ids.shape[0] * nblocks, cuda.gridsize(1)):
        i, b = task // nblocks, task % nblocks
        count = decode_block(code, u8, i8, u16, f32, ids[i], b, cols, f16, bf16, vals)
        for j in range(count):
            out[i, b * block_values + j] = vals[j]


def _nblocks(w: CudaWeight) -> int:
    return -(-w.cols // w.block_values)


def matmul(x: DeviceArray, w: CudaWeight, tables: Tables) -> DeviceArray:
    """x [n, cols] float32 times w^T -> [n, rows] float32."""
    if x.shape[-1] != w.cols:
        raise ValueError(f"matmul: x has {x.shape[-1]} columns, the weight {w.cols}")
    n = x.shape[0]
    out = empty((n, w.rows))
    if n:
        tasks = w.rows * -(-n // TILE)
        _matmul[flat_grid(tasks)](x.raw, w.code, w.u8, w.i8, w.u16, w.f32, w.rows, w.cols, _nblocks(w),
                                  tables.f16, tables.bf16, out.raw)
    return out


def embedding(w: CudaWeight, ids: DeviceArray, tables: Tables) -> DeviceArray:
    """Rows `ids` of w, decoded -> [len(ids), cols] float32."""
    out = empty((len(ids), w.cols))
    if len(ids):
        nb = _nblocks(w)
        _embedding[flat_grid(len(ids) * nb)](ids.raw, w.code, w.u8, w.i8, w.u16, w.f32, w.cols, nb, w.block_values,
                                             tables.f16, tables.bf16, out.raw)
    return out
