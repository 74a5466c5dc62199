"""The paged KV cache on the GPU: storage in every KV dtype, the write kernel that converts rows as
they are stored, and the attention kernel that reads (and decodes) them in place.

The layout is the CPU cache's (kernels/cpu/paged_attention.py): per layer, n_blocks blocks of
block_size rows [kv_heads, head_dim], as f32, f16 or bf16 bits, or q8_0 (int8 values plus one f16
scale per 32, ggml's block_q8_0 split in two arrays), with 1-element placeholders for the arrays a
dtype does not use. The write kernel converts bit-exactly as kernels/convert.py does (f16 and bf16
round to nearest even from the float32 bits; q8_0 is ggml's quantize_row_q8_0_ref), so a cache
written on the GPU holds the bytes the CPU's would.

Attention runs one block per (token, query head) with an online softmax over chunks of THREADS
keys: each lane scores one key of the chunk, the block agrees on the running max and sum through the
reduction helper, and each lane accumulates its own slice of head_dim. Any context length runs in
fixed memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int64

from ember.kernels.convert import KV_DTYPES, QK8_0
from ember.kernels.cuda.device import THREADS, block_max, block_sum, flat_grid, grid
from ember.kernels.cuda.device_array import DeviceArray, empty, zeros
from ember.kernels.cuda.quant_matmul import Tables

MODE = {name: i for i, name in enumerate(KV_DTYPES)}
_F32, _F16, _BF16, _Q8_0 = MODE["f32"], MODE["f16"], MODE["bf16"], MODE["q8_0"]
MAX_HEAD_DIM = 512
_SLICE = MAX_HEAD_DIM // THREADS  # head_dim values one lane accumulates


@dataclass(frozen=True)
class CudaKVStore:
    mode: int
    f32: Any  # [n_blocks, block_size, kv_heads, head_dim] float32
    u16: Any  # same shape, f16/bf16 bits
    i8: Any  # same shape, q8_0 values
    scales: Any  # [n_blocks, block_size, kv_heads, head_dim // 32] f16 bits of q8_0 scales

    @classmethod
    def allocate(cls, dtype: str, n_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> CudaKVStore:
        if dtype not in MODE:
            raise ValueError(f"unknown KV dtype {dtype!r} (choose from {', '.join(KV_DTYPES)})")
        if dtype == "q8_0" and head_dim % QK8_0:
            raise ValueError(f"q8_0 KV cache needs head_dim divisible by {QK8_0}, got {head_dim}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim {head_dim} exceeds the CUDA attention kernel's {MAX_HEAD_DIM}")
        shape, tiny = (n_blocks, block_size, kv_heads, head_dim), (1, 1, 1, 1)

        def store(used: bool, dt: Any, full: tuple[int, ...] = shape) -> Any:
            return zeros(full if used else tiny, dt).raw

        return cls(MODE[dtype], store(dtype == "f32", np.float32), store(dtype in ("f16", "bf16"), np.uint16),
                   store(dtype == "q8_0", np.int8), store(dtype == "q8_0", np.uint16, shape[:3] + (head_dim // QK8_0,)))

    @property
    def nbytes(self) -> int:
        return int(self.f32.nbytes + self.u16.nbytes + self.i8.nbytes + self.scales.nbytes)


# --- float32 -> storage bits, as kernels/convert.py -----------------------------------------------
@cuda.jit(device=True)
def _round_shift(m, shift):  # type: ignore[no-untyped-def]
    """m >> shift, rounded to nearest, ties to even."""
    out = m >> shift
    rem = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and (out & 1)):
        out += 1
    return out


@cuda.jit(device=True)
def f16_bits(u):  # type: ignore[no-untyped-def]
    """IEEE half bits of the float32 with bits u (round to nearest even, subnormals, overflow to inf)."""
    u = int(u)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN stays NaN, with its top payload bits and the quiet bit
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:  # rounds past 65504
        return sign | 0x7C00
    if a >= 0x38800000:  # a normal half: rebias the exponent, round the mantissa
        return sign | _round_shift(a - 0x38000000, 13)
    if a <= 0x33000000:  # at most half the smallest subnormal: rounds to zero (the tie to even)
        return sign
    e = a >> 23
    return sign | _round_shift((a & 0x7FFFFF) | 0x800000, 126 - e)


@cuda.jit(device=True)
def bf16_bits(u):  # type: ignore[no-untyped-def]
    """bfloat16 bits of the float32 with bits u, as ggml_compute_fp32_to_bf16."""
    u = int(u)
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


@cuda.jit
def _kv_write(rows, bits, blocks, offsets, mode, f32, u16, i8, scales):  # type: ignore[no-untyped-def]
    # one item = (token, kv head, group of 32 values): a q8_0 group is one quantization block
    n, heads, hd = rows.shape
    groups = (hd + QK8_0 - 1) // QK8_0
    for item in range(cuda.grid(1), n * heads * groups, cuda.gridsize(1)):
        i, h, g = item // (heads * groups), (item // groups) % heads, item % groups
        blk, off = blocks[i], offsets[i]
        start, stop = g * QK8_0, min(hd, (g + 1) * QK8_0)
        if mode == _F32:
            for j in range(start, stop):
                f32[blk, off, h, j] = rows[i, h, j]
        elif mode == _F16:
            for j in range(start, stop):
                u16[blk, off, h, j] = f16_bits(bits[i, h, j])
        elif mode == _BF16:
            for j in range(start, stop):
                u16[blk, off, h, j] = bf16_bits(bits[i, h, j])
        else:  # ggml's quantize_row_q8_0_ref, every step rounded to float32 as the reference does
            amax = float32(0)
            for j in range(start, stop):
                amax = max(amax, abs(rows[i, h, j]))
            d = float32(amax / float32(127))
            inv = float32(0) if d == 0 else float32(float32(1) / d)
            for j in range(start, stop):
                v = float32(rows[i, h, j] * inv)
                a = abs(v)
                q = 0
                if not (math.isnan(a) or math.isinf(a)):  # a non-finite product is stored as 0
                    floored = math.floor(a)
                    q = int(floored + math.floor(2 * (a - floored)))  # roundf: halves away from zero
                i8[blk, off, h, j] = q if v >= 0 else -q
            scales[blk, off, h, g] = f16_bits(_f32_bits(d))


@cuda.jit(device=True)
def _f32_bits(x):  # type: ignore[no-untyped-def]
    """The bits of a non-negative, finite float32 (a q8_0 scale), built arithmetically: no bit casts in
    numba.cuda's Python dialect."""
    if x == 0:
        return 0
    e = 0
    m = float(x)
    while m >= 2.0:
        m *= 0.5
        e += 1
    while m < 1.0:
        m *= 2.0
        e -= 1
    if e < -126:  # subnormal
        return int(float(x) * 2.0**149)
    return ((e + 127) << 23) | int((m - 1.0) * 8388608.0)


def kv_write(store: CudaKVStore, blocks: DeviceArray, offsets: DeviceArray, rows: DeviceArray) -> None:
    """Store rows [n, kv_heads, head_dim] (float32) at (blocks[i], offsets[i])."""
    n, heads, hd = rows.shape
    if n == 0:
        return
    bits = rows.view(np.uint32)
    _kv_write[flat_grid(n * heads * -(-hd // QK8_0))](rows.raw, bits.raw, blocks.raw, offsets.raw, store.mode,
                                                      store.f32, store.u16, store.i8, store.scales)


# --- attention -----------------------------------------------------------------------------------
@cuda.jit(device=True)
def _kv(f32, u16, i8, scales, mode, blk, off, h, j, lut, f16):  # type: ignore[no-untyped-def]
    if mode == _F32:
        return f32[blk, off, h, j]
    if mode == _Q8_0:
        return float32(i8[blk, off, h, j]) * f16[scales[blk, off, h, j // QK8_0]]
    return lut[u16[blk, off, h, j]]


@cuda.jit
def _attention(q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, lut, f16,  # type: ignore[no-untyped-def]
               tables, token_seq, positions, window, scale, out):
    scratch = cuda.shared.array(THREADS, float32)
    probs = cuda.shared.array(THREADS, float32)
    acc = cuda.local.array(_SLICE, float32)
    n, hq, hd = q.shape
    block_size = max(k_f32.shape[1], k_u16.shape[1], k_i8.shape[1])
    kv_heads = max(k_f32.shape[2], k_u16.shape[2], k_i8.shape[2])
    group = hq // kv_heads
    t, width = cuda.threadIdx.x, cuda.blockDim.x
    for task in range(cuda.blockIdx.x, n * hq, cuda.gridDim.x):
        i, h = task // hq, task % hq
        kv, seq, visible = h // group, token_seq[i], positions[i] + 1
        first = visible - window if 0 < window < visible else 0  # a sliding window's oldest key
        for a in range(_SLICE):
            acc[a] = float32(0)
        run_max, run_sum = float32(-math.inf), float32(0)
        for base in range(first, visible, width):
            pos = base + t
            s = float32(-math.inf)
            if pos < visible:
                blk, off = tables[seq, pos // block_size], pos % block_size
                dot = float32(0)
                for j in range(hd):
                    dot += q[i, h, j] * _kv(k_f32, k_u16, k_i8, k_sc, mode, blk, off, kv, j, lut, f16)
                s = dot * scale
            new_max = max(run_max, block_max(s, scratch))  # finite: the chunk has at least one key
            p = float32(math.exp(s - new_max)) if pos < visible else float32(0)
            correction = float32(math.exp(run_max - new_max))
            run_sum = run_sum * correction + block_sum(p, scratch)
            probs[t] = p
            cuda.syncthreads()
            keys = min(width, visible - base)
            for a in range(_SLICE):
                j = t + a * width
                if j < hd:
                    total = acc[a] * correction
                    for c in range(keys):
                        blk, off = tables[seq, (base + c) // block_size], (base + c) % block_size
                        total += probs[c] * _kv(v_f32, v_u16, v_i8, v_sc, mode, blk, off, kv, j, lut, f16)
                    acc[a] = total
            cuda.syncthreads()  # probs is rewritten by the next chunk
            run_max = new_max
        for a in range(_SLICE):
            j = t + a * width
            if j < hd:
                out[i, h, j] = acc[a] / run_sum


def paged_attention(q: DeviceArray, k: CudaKVStore, v: CudaKVStore, tables: DeviceArray, token_seq: DeviceArray,
                    positions: DeviceArray, scale: float, luts: Tables, window: int = 0) -> DeviceArray:
    """Causal GQA attention of q [n, hq, hd] over the paged stores (see Ops.paged_attention)."""
    n, hq, _ = q.shape
    out = empty(q.shape)
    if n:
        lut = luts.bf16 if k.mode == _BF16 else luts.f16
        _attention[grid(n * hq)](q.raw, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8, v.scales, k.mode, lut,
                                 luts.f16, tables.raw, token_seq.raw, positions.raw, int64(window), float32(scale),
                                 out.raw)
    return out
