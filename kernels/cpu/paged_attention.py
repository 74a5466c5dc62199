"""Paged KV storage on the CPU and the attention kernel that reads it directly, in every KV dtype.

A layer's cache is `n_blocks` blocks of `block_size` token rows, each row [kv_heads, head_dim] stored
as f32, f16 or bf16 bits (uint16), or q8_0 (int8 values plus one f16 scale per 32 values, ggml's
block_q8_0 split into two arrays). Writes convert with kernels/convert.py, the one implementation of
each conversion (numpy: a step writes a few rows); the attention kernel dequantizes key/value rows as it
reads them, through lookup tables built from those same conversions, so no f32 copy of the cache ever
exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ember.kernels.convert import (KV_DTYPES, QK8_0, bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits,
                                   f32_to_f16_bits, quantize_q8_0_split)
from ember.kernels.cpu.twin import Twin

MODE = {name: i for i, name in enumerate(KV_DTYPES)}
# The kernel branches on these (numba freezes module-level ints into constants), so it does not
# depend on the order of KV_DTYPES.
_F32, _BF16, _Q8_0 = MODE["f32"], MODE["bf16"], MODE["q8_0"]

# f16 and bf16 bit patterns -> float32 (numba has no float16; a table lookup is exact and cheap)
_ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
F16_TABLE = f16_bits_to_f32(_ALL_BITS)
BF16_TABLE = bf16_bits_to_f32(_ALL_BITS)


@dataclass
class KVLayerStore:
    """One layer's K or V storage; the arrays a mode does not use are 1-element placeholders so one
    compiled kernel serves every dtype."""
    mode: int
    f32: np.ndarray  # [n_blocks, block_size, kv_heads, head_dim] float32
    u16: np.ndarray  # same shape, f16/bf16 bits
    i8: np.ndarray  # same shape, q8_0 values
    scales: np.ndarray  # [n_blocks, block_size, kv_heads, head_dim // 32] f16 bits of q8_0 scales

    @classmethod
    def allocate(cls, dtype: str, n_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> KVLayerStore:
        if dtype not in MODE:
            raise ValueError(f"unknown KV dtype {dtype!r} (choose from {', '.join(KV_DTYPES)})")
        if dtype == "q8_0" and head_dim % QK8_0:
            raise ValueError(f"q8_0 KV cache needs head_dim divisible by {QK8_0}, got {head_dim}")
        shape = (n_blocks, block_size, kv_heads, head_dim)
        tiny = (1, 1, 1, 1)
        return cls(
            mode=MODE[dtype],
            f32=np.zeros(shape if dtype == "f32" else tiny, np.float32),
            u16=np.zeros(shape if dtype in ("f16", "bf16") else tiny, np.uint16),
            i8=np.zeros(shape if dtype == "q8_0" else tiny, np.int8),
            scales=np.zeros(shape[:3] + (head_dim // QK8_0,) if dtype == "q8_0" else tiny, np.uint16),
        )

    @property
    def nbytes(self) -> int:
        return self.f32.nbytes + self.u16.nbytes + self.i8.nbytes + self.scales.nbytes

    def write(self, blocks: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> None:
        """Store rows [n, kv_heads, head_dim] (float32) at (blocks[i], offsets[i])."""
        if self.mode == MODE["f32"]:
            self.f32[blocks, offsets] = rows
        elif self.mode == MODE["f16"]:
            self.u16[blocks, offsets] = f32_to_f16_bits(rows)
        elif self.mode == MODE["bf16"]:
            self.u16[blocks, offsets] = f32_to_bf16_bits(rows)
        else:
            scales, quants = quantize_q8_0_split(rows)
            self.i8[blocks, offsets] = quants
            self.scales[blocks, offsets] = scales


@njit(inline="always", fastmath=True, nogil=True, cache=True)
def _load_row(s_f32, s_u16, s_i8, s_scales, mode, blk, off, h, lut, out):  # type: ignore[no-untyped-def]
    hd = out.size
    if mode == _F32:
        for j in range(hd):
            out[j] = s_f32[blk, off, h, j]
    elif mode == _Q8_0:
        for g in range(hd // QK8_0):
            d = lut[s_scales[blk, off, h, g]]  # the f16 table: scales are f16 whatever the mode
            for j in range(QK8_0):
                out[g * QK8_0 + j] = s_i8[blk, off, h, g * QK8_0 + j] * d
    else:
        for j in range(hd):
            out[j] = lut[s_u16[blk, off, h, j]]


@njit(inline="always", fastmath=True, nogil=True, cache=True)
def _row(s_f32, s_u16, s_i8, s_scales, mode, blk, off, h, lut, scratch):  # type: ignore[no-untyped-def]
    """One stored K/V row as float32: a view of the cache for f32, else decoded into scratch."""
    if mode == _F32:
        return s_f32[blk, off, h]
    _load_row(s_f32, s_u16, s_i8, s_scales, mode, blk, off, h, lut, scratch)
    return scratch


def _paged_attention(q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, lut,  # type: ignore[no-untyped-def]
                     tables, token_seq, positions, scale, out):
    # One task per (token, KV head): each key and value row is read (and decoded) once for all the
    # query heads that share it (GQA), and f32 rows are read in place.
    kv_heads = max(k_f32.shape[2], k_u16.shape[2], k_i8.shape[2])
    for task in prange(q.shape[0] * kv_heads):
        attention_task(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, lut, tables, token_seq,
                       positions, scale, out)


@njit(fastmath=True, nogil=True, cache=True)
def attention_task(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, lut,  # type: ignore[no-untyped-def]
                   tables, token_seq, positions, scale, out):
    """Task `task` of _paged_attention: token task // kv_heads, KV head task % kv_heads, all the
    query heads that read it. One compiled function that the serial and the parallel kernel and the
    fused layer's thread team (decoder_layer.py) all call, so each computes every task alike."""
    n, hq, hd = q.shape
    block_size = max(k_f32.shape[1], k_u16.shape[1], k_i8.shape[1])
    kv_heads = max(k_f32.shape[2], k_u16.shape[2], k_i8.shape[2])
    group = hq // kv_heads
    i, kv = task // kv_heads, task % kv_heads
    seq, visible = token_seq[i], positions[i] + 1
    scores = np.empty((group, visible), np.float32)
    scratch = np.empty(hd, np.float32)
    for t in range(visible):
        krow = _row(k_f32, k_u16, k_i8, k_sc, mode, tables[seq, t // block_size], t % block_size, kv, lut, scratch)
        for g in range(group):
            qh = q[i, kv * group + g]  # 1-D views: the dot vectorizes (no per-element index checks)
            s = np.float32(0)
            for j in range(hd):
                s += qh[j] * krow[j]
            scores[g, t] = s * scale
    total = np.zeros(group, np.float32)
    for g in range(group):
        best = scores[g, 0]
        for t in range(1, visible):
            best = max(best, scores[g, t])
        for t in range(visible):
            e = np.exp(scores[g, t] - best)  # float32 expf (math.exp would go through float64)
            scores[g, t] = e
            total[g] += e
    acc = np.zeros((group, hd), np.float32)
    for t in range(visible):
        vrow = _row(v_f32, v_u16, v_i8, v_sc, mode, tables[seq, t // block_size], t % block_size, kv, lut, scratch)
        for g in range(group):
            p, a = scores[g, t], acc[g]
            for j in range(hd):
                a[j] += p * vrow[j]
    for g in range(group):
        o, a, inv = out[i, kv * group + g], acc[g], np.float32(1) / total[g]
        for j in range(hd):
            o[j] = a[j] * inv


_KERNELS = Twin(_paged_attention)


def paged_attention(q: np.ndarray, k: KVLayerStore, v: KVLayerStore, tables: np.ndarray, token_seq: np.ndarray,
                    positions: np.ndarray, scale: float) -> np.ndarray:
    """Causal GQA attention of q [n, hq, hd]: token i belongs to sequence token_seq[i], sits at
    positions[i] and sees that sequence's keys 0..positions[i], found through tables[seq] (block ids).
    """
    out = np.empty_like(q)
    lut = BF16_TABLE if k.mode == _BF16 else F16_TABLE
    work = q.size * 2 * (int(positions[-1]) + 1)  # the last token's context stands for the step's (cheap)
    _KERNELS.pick(work)(q, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8, v.scales, k.mode, lut,
                        tables, token_seq, positions, np.float32(scale), out)
    return out
