"""Paged KV storage on the CPU and the attention kernel that reads it directly, in every KV dtype.

A layer's cache is `n_blocks` blocks of `block_size` token rows [kv_heads, head_dim], each value stored
as f32, f16 or bf16 bits (uint16), or q8_0 (int8 values plus one f16 scale per 32 values, ggml's
block_q8_0 split into two arrays). A block keeps each KV head's rows together; V as rows, K
transposed ([head_dim, block_size] per head: a dimension's values for the block's keys side by
side), so that the score pass multiplies 16 keys at once with no horizontal sums
(attention_vectors.py). Writes convert with kernels/convert.py, the one implementation of each
conversion (numpy: a step writes a few rows; store_kv_rows in compiled code, the same bits); the
attention kernel reads keys and values where they are stored, in every dtype, so no f32 copy of the
cache ever exists: f16 and bf16 values are widened as they are loaded (`fpext` of half: F16C's
vcvtph2ps; bf16: the bits moved up 16), q8_0 values converted from int8, each 32-value group's sum
times its f16 scale.

Measured (benchmarks/attention.py: 1536 positions, 12 query heads on 4 KV heads of 64, 2 threads,
per layer with 12 layers' caches taking turns, so read from memory; hot: one layer's):
- 2-core Zen 3 VM (AVX2), 2026-11-30: f16 200 -> 66 us (hot 108 -> 55), f32 370 -> 160, bf16 232 ->
  73, q8_0 144 -> 91, from K stored as rows, four keys' dots at a time each summed across its
  vector, and value rows widened again for each query head of the group, with no prefetch.
- 2-core Zen 5 VM, the row layout: f32 174 us, f16 62 us, bf16 62 us, q8_0 73 us (widened into a
  scratch row first, as before 2026-11-29: f16 72 us, q8_0 196 us).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ember.kernels.convert import _BF16_QUIET, KV_DTYPES, QK8_0, f32_to_bf16_bits, f32_to_f16_bits, quantize_q8_0_split
from ember.kernels.cpu import attention_vectors
from ember.kernels.cpu.int8_dots import _round_half_away
from ember.kernels.cpu.dense import exp_nonpositive as _exp
from ember.kernels.cpu.twin import Twin

MODE = {name: i for i, name in enumerate(KV_DTYPES)}
# The kernel branches on these (numba freezes module-level ints into constants), so it does not
# depend on the order of KV_DTYPES.
_F32, _F16, _BF16, _Q8_0 = MODE["f32"], MODE["f16"], MODE["bf16"], MODE["q8_0"]
# blocks ahead whose rows a task prefetches: without the hint the kernel waited on memory (f16, 1536
# positions, 12 layers' caches in turn: 95 us a layer, 64 with it; hot 55)
AHEAD = 2


@dataclass(eq=False)  # a store is itself, not its arrays' values: hashed by identity (a weak key)
class KVLayerStore:
    """One layer's K or V storage; the arrays a mode does not use are 1-element placeholders so one
    compiled kernel serves every dtype. Each block holds each KV head's rows together: V as rows
    [n_blocks, kv_heads, block_size, head_dim], K transposed, [n_blocks, kv_heads, head_dim,
    block_size], for the score pass's key-wide vectors (attention_vectors.py). q8_0 scales are laid out as
    their values, one per 32 of head_dim."""
    mode: int
    keys: bool  # K (transposed) or V
    f32: np.ndarray  # float32 values, in the layout above
    u16: np.ndarray  # f16/bf16 bits
    i8: np.ndarray  # q8_0 values
    scales: np.ndarray  # f16 bits of the q8_0 scales

    @classmethod
    def allocate(cls, dtype: str, n_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 keys: bool) -> KVLayerStore:
        if dtype not in MODE:
            raise ValueError(f"unknown KV dtype {dtype!r} (choose from {', '.join(KV_DTYPES)})")
        if dtype == "q8_0" and head_dim % QK8_0:
            raise ValueError(f"q8_0 KV cache needs head_dim divisible by {QK8_0}, got {head_dim}")

        def shape(width: int) -> tuple[int, ...]:
            return (n_blocks, kv_heads, width, block_size) if keys else (n_blocks, kv_heads, block_size, width)

        tiny = (1, 1, 1, 1)
        return cls(
            mode=MODE[dtype], keys=keys,
            f32=np.zeros(shape(head_dim) if dtype == "f32" else tiny, np.float32),
            u16=np.zeros(shape(head_dim) if dtype in ("f16", "bf16") else tiny, np.uint16),
            i8=np.zeros(shape(head_dim) if dtype == "q8_0" else tiny, np.int8),
            scales=np.zeros(shape(head_dim // QK8_0) if dtype == "q8_0" else tiny, np.uint16),
        )

    @property
    def nbytes(self) -> int:
        return self.f32.nbytes + self.u16.nbytes + self.i8.nbytes + self.scales.nbytes

    def _at(self, blocks: np.ndarray, offsets: np.ndarray) -> tuple:  # type: ignore[type-arg]
        # numpy puts the broadcast dimension of indices split by a slice first: [n, kv_heads, width]
        return (blocks, slice(None), slice(None), offsets) if self.keys else (blocks, slice(None), offsets)

    def write(self, blocks: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> None:
        """Store rows [n, kv_heads, head_dim] (float32) at (blocks[i], offsets[i])."""
        at = self._at(blocks, offsets)
        if self.mode == MODE["f32"]:
            self.f32[at] = rows
        elif self.mode == MODE["f16"]:
            self.u16[at] = f32_to_f16_bits(rows)
        elif self.mode == MODE["bf16"]:
            self.u16[at] = f32_to_bf16_bits(rows)
        else:
            scales, quants = quantize_q8_0_split(rows)
            self.i8[at] = quants
            self.scales[at] = scales

    def stored(self, blocks: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored form of the rows at (blocks[i], offsets[i]): (values [n, kv_heads, head_dim] as
        held: float32, f16/bf16 bits or q8_0 int8; q8_0 scales [n, kv_heads, head_dim / 32] f16 bits, or
        an empty array)."""
        at = self._at(blocks, offsets)
        values = {MODE["f32"]: self.f32, MODE["q8_0"]: self.i8}.get(self.mode, self.u16)[at]
        return values, self.scales[at] if self.mode == MODE["q8_0"] else np.zeros(0, np.uint16)


def _conversion(name: str, arg, ret, emit):  # type: ignore[no-untyped-def]
    """An intrinsic name(v) -> ret for a v of numba type `arg`, its value emit(builder, v) in LLVM IR
    (numba has no half type and no bitcast)."""
    def typer(typingctx, v):  # type: ignore[no-untyped-def]
        if v != arg:
            return None

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            return emit(builder, args[0])

        return ret(v), codegen

    typer.__name__ = name
    return intrinsic(typer)


_I16, _I32 = ir.IntType(16), ir.IntType(32)
# float32 -> the bits of the nearest IEEE half, ties to even (LLVM's fptrunc: vcvtps2ph with F16C), as
# convert.f32_to_f16_bits (numpy's astype) rounds: out of range is infinity, a NaN stays NaN
_f16_bits = _conversion("_f16_bits", types.float32, types.uint16,
                        lambda b, v: b.bitcast(b.fptrunc(v, ir.HalfType()), _I16))
_f32_bits = _conversion("_f32_bits", types.float32, types.uint32, lambda b, v: b.bitcast(v, _I32))
# the float32 value of f16 bits, exactly (LLVM's fpext: a loop of them vectorizes to F16C's vcvtph2ps)
_f16_value = _conversion("_f16_value", types.uint16, types.float32,
                         lambda b, v: b.fpext(b.bitcast(v, ir.HalfType()), ir.FloatType()))
# the float32 value of bf16 bits: the top half of a float32
_bf16_value = _conversion("_bf16_value", types.uint16, types.float32,
                          lambda b, v: b.bitcast(b.shl(b.zext(v, _I32), ir.Constant(_I32, 16)), ir.FloatType()))


@njit(inline="always", cache=True, nogil=True)
def _bf16_bits(v):  # type: ignore[no-untyped-def]
    """convert.f32_to_bf16_bits of one float32 (in int64: no wraparound, as there)."""
    u = np.int64(_f32_bits(v))
    if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN: its top bits, quiet
        return np.uint16((u >> 16) | _BF16_QUIET)
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@njit(inline="always", cache=True, nogil=True)
def store_row(mode, row, f32, u16, blk, off, keys):  # type: ignore[no-untyped-def]
    """A K (keys: stored transposed) or V row (float32 [kv_heads, head_dim]) into an f32, f16 or bf16
    store at (blk, off), in compiled code, converted bit for bit as KVLayerStore.write converts it
    (kernels/convert.py; the fused layers store their rows with it; q8_0 rows: store_row_q8_0)."""
    for h in range(row.shape[0]):
        for j in range(row.shape[1]):
            if mode == _F32:
                value = row[h, j]
                if keys:
                    f32[blk, h, j, off] = value
                else:
                    f32[blk, h, off, j] = value
            else:
                bits = _f16_bits(row[h, j]) if mode == _F16 else _bf16_bits(row[h, j])
                if keys:
                    u16[blk, h, j, off] = bits
                else:
                    u16[blk, h, off, j] = bits


@njit(inline="always", cache=True, nogil=True)
def store_row_q8_0(row, i8, scales, blk, off, keys):  # type: ignore[no-untyped-def]
    """A K (keys) or V row (float32 [kv_heads, head_dim]) into a q8_0 store at (blk, off), in compiled code,
    quantized as KVLayerStore.write quantizes it (convert.quantize_q8_0_split), inputs it leaves
    undefined included: a NaN makes its block's scale NaN, and a value whose x * (1/d) is not finite
    is stored as 0. No fast-math (the caller's): the rounding is float32's."""
    for h in range(row.shape[0]):
        for b in range(row.shape[1] // QK8_0):
            amax = np.float32(0)
            for j in range(b * QK8_0, (b + 1) * QK8_0):
                a = abs(row[h, j])
                if a > amax or (a != a and amax == amax):  # numpy's max: the first NaN wins
                    amax = a
            d = amax / np.float32(127)
            inv = np.float32(0) if d == 0 else np.float32(1) / d
            if keys:
                scales[blk, h, b, off] = _f16_bits(d)
            else:
                scales[blk, h, off, b] = _f16_bits(d)
            for j in range(b * QK8_0, (b + 1) * QK8_0):
                v = row[h, j] * inv
                q = np.int8(_round_half_away(v)) if np.isfinite(v) else np.int8(0)
                if keys:
                    i8[blk, h, j, off] = q
                else:
                    i8[blk, h, off, j] = q


@njit(inline="always", cache=True, nogil=True)
def store_kv_rows(mode, k_row, v_row, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, blk, off):  # type: ignore[no-untyped-def]
    """A token's K and V rows into their stores at (blk, off), in any KV dtype, as KVLayerStore.write
    stores them: the fused layers' K/V write."""
    if mode == _Q8_0:
        store_row_q8_0(k_row, k_i8, k_sc, blk, off, True)
        store_row_q8_0(v_row, v_i8, v_sc, blk, off, False)
    else:
        store_row(mode, k_row, k_f32, k_u16, blk, off, True)
        store_row(mode, v_row, v_f32, v_u16, blk, off, False)


def _paged_attention(q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode,  # type: ignore[no-untyped-def]
                     tables, token_seq, positions, window, scale, out):
    # One task per (token, KV head): each key and value row is read (and decoded) once for all the
    # query heads that share it (GQA). The threads take contiguous shares of the loop, and a prompt
    # chunk's later tokens see more keys: the tokens are taken from both ends in turn (0, n-1, 1,
    # n-2, ...), so that each share holds early and late ones alike.
    kv_heads = max(k_f32.shape[1], k_u16.shape[1], k_i8.shape[1])
    n = q.shape[0]
    for p in prange(n * kv_heads):  # int64 below: prange's index is unsigned, a second signature
        i = np.int64(p) // kv_heads
        token = i // 2 if i % 2 == 0 else n - 1 - i // 2  # zigzag: see below
        attention_task(token * kv_heads + np.int64(p) % kv_heads, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8,
                       v_sc, mode, tables, token_seq, positions, window, scale, out)


@njit(fastmath=True, nogil=True, cache=True)
def attention_task(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode,  # type: ignore[no-untyped-def]
                   tables, token_seq, positions, window, scale, out):
    """Task `task` of _paged_attention: token task // kv_heads, KV head task % kv_heads, all the
    query heads that read it. One compiled function that the serial and the parallel kernel and the
    fused layer's thread team (decoder_layer.py) all call, so each computes every task alike.

    The scores of up to four query heads against a block's 16 keys come from one intrinsic call
    (attention_vectors.block_scores: each key vector loaded once for all of them; a block of fewer
    keys, or a block's last ones, through masked loads). The value rows of a block are added into
    every head's accumulators by one call (block_values), head dims it cannot take (not a multiple
    of 16) four rows at a time. What a token computes, and in what order, depends only on its own
    position, so its output depends neither on the rest of its batch nor on the block size (a draft
    engine's blocks may differ from its target's). Each dtype has code of its own: with the mode a
    branch in every row's decoding, an f16 cache's attention took twice as long (231 -> 113 us, 1536
    positions, 6 query heads on 2 KV heads, 2 threads). Rows are addressed by index, never as array
    views (a view costs reference counting), and found block by block with no division (one per
    row cost a tenth of the time at 1536 positions)."""
    if mode == _F32:
        _ATTEND_F32(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, tables, token_seq, positions,
                    window, scale, out)
    elif mode == _F16:
        _ATTEND_F16(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, tables, token_seq, positions,
                    window, scale, out)
    elif mode == _BF16:
        _ATTEND_BF16(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, tables, token_seq, positions,
                     window, scale, out)
    else:
        _ATTEND_Q8_0(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, tables, token_seq, positions,
                     window, scale, out)


@njit(inline="always", nogil=True, cache=True)
def _carried(n, off, block_size):  # type: ignore[no-untyped-def]
    """(table index, row) of the position `off` rows past the start of block table[n], a few rows at
    most (a loop, not a division: one per row cost a tenth of the kernel's time)."""
    while off >= block_size:
        off -= block_size
        n += 1
    return n, off


@njit(inline="always", nogil=True, cache=True)
def _row(table, n, off, block_size):  # type: ignore[no-untyped-def]
    """(block, row) of that position."""
    n, off = _carried(n, off, block_size)
    return table[n], off


@njit(inline="always", nogil=True, cache=True)
def _four_rows(table, n, off, block_size, beyond):  # type: ignore[no-untyped-def]
    """(block, row) of each of the four positions from row `off` of block table[n] on; those past the
    last real one (`beyond` positions on) repeat it (they get weight 0)."""
    b0, o0 = _row(table, n, off, block_size)
    b1, o1 = _row(table, n, off + min(1, beyond), block_size)
    b2, o2 = _row(table, n, off + min(2, beyond), block_size)
    b3, o3 = _row(table, n, off + min(3, beyond), block_size)
    return b0, o0, b1, o1, b2, o2, b3, o3


def _attend_for(mode: int):  # type: ignore[no-untyped-def]
    """attention_task's body for a store of `mode` (a constant of the compiled code: no variant
    branches on it), its rows read in place: f16 and bf16 values widened as they are loaded, q8_0
    values scaled once per 32-value group of each dot."""
    width = QK8_0 if mode == _Q8_0 else 0  # values per scale; 0: the whole row, unscaled
    kind = {_F32: "f32", _F16: "f16", _BF16: "bf16", _Q8_0: "q8_0"}[mode]
    block_scores, block_values = attention_vectors.block_scores(kind), attention_vectors.block_values(kind)

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def value(s_f32, s_u16, s_i8, a, b, c, d):  # type: ignore[no-untyped-def]
        if mode == _F32:
            return s_f32[a, b, c, d]
        if mode == _F16:
            return _f16_value(s_u16[a, b, c, d])
        if mode == _BF16:
            return _bf16_value(s_u16[a, b, c, d])
        return np.float32(s_i8[a, b, c, d])

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def group_scale(s_sc, a, b, c, d):  # type: ignore[no-untyped-def]
        return _f16_value(s_sc[a, b, c, d]) if mode == _Q8_0 else np.float32(1)

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def scores_of(q, i, h0, heads, s_f32, s_u16, s_i8, s_sc, b, kv, c, count, scale, scores, g0, col):  # type: ignore[no-untyped-def]
        """scores[g0 + h, col:col + count] = the scaled scores of query heads h0 .. h0 + heads - 1
        against keys c .. c + count - 1 of block b."""
        if mode == _F32:
            block_scores(s_f32, s_sc, b, kv, c, count, q, i, h0, heads, scale, scores, g0, col)
        elif mode == _Q8_0:
            block_scores(s_i8, s_sc, b, kv, c, count, q, i, h0, heads, scale, scores, g0, col)
        else:
            block_scores(s_u16, s_sc, b, kv, c, count, q, i, h0, heads, scale, scores, g0, col)

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def prefetch(s_f32, s_u16, s_i8, b, kv):  # type: ignore[no-untyped-def]
        if mode == _F32:
            attention_vectors.prefetch_block(s_f32, b, kv)
        elif mode == _Q8_0:
            attention_vectors.prefetch_block(s_i8, b, kv)
        else:
            attention_vectors.prefetch_block(s_u16, b, kv)

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def values_of(s_f32, s_u16, s_i8, s_sc, b, kv, lo, hi, weights, col, g0, heads, acc):  # type: ignore[no-untyped-def]
        """acc[g0 + h] += weights[g0 + h, col + o] x row o of block b for o in [lo, hi), for h < heads."""
        if mode == _F32:
            block_values(s_f32, s_sc, b, kv, lo, hi, weights, col, g0, heads, acc)
        elif mode == _Q8_0:
            block_values(s_i8, s_sc, b, kv, lo, hi, weights, col, g0, heads, acc)
        else:
            block_values(s_u16, s_sc, b, kv, lo, hi, weights, col, g0, heads, acc)

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def add_four(acc, g, p0, p1, p2, p3, s_f32, s_u16, s_i8, s_sc, kv, b0, o0, b1, o1, b2, o2, b3, o3):  # type: ignore[no-untyped-def]
        """acc[g] += p0 row0 + p1 row1 + p2 row2 + p3 row3, in a fixed order."""
        hd = acc.shape[1]
        w = width if width else hd
        for grp in range(hd // w):
            w0, w1 = p0 * group_scale(s_sc, b0, kv, o0, grp), p1 * group_scale(s_sc, b1, kv, o1, grp)
            w2, w3 = p2 * group_scale(s_sc, b2, kv, o2, grp), p3 * group_scale(s_sc, b3, kv, o3, grp)
            for d in range(grp * w, grp * w + w):
                acc[g, d] += (w0 * value(s_f32, s_u16, s_i8, b0, kv, o0, d) + w1 * value(s_f32, s_u16, s_i8, b1, kv, o1, d)) \
                    + (w2 * value(s_f32, s_u16, s_i8, b2, kv, o2, d) + w3 * value(s_f32, s_u16, s_i8, b3, kv, o3, d))

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def attend(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc,  # type: ignore[no-untyped-def]
               tables, token_seq, positions, window, scale, out):
        n, hq, hd = q.shape
        block_size = max(k_f32.shape[3], k_u16.shape[3], k_i8.shape[3])
        kv_heads = max(k_f32.shape[1], k_u16.shape[1], k_i8.shape[1])
        group = hq // kv_heads
        i, kv = task // kv_heads, task % kv_heads
        seq, visible = token_seq[i], positions[i] + 1
        first = visible - window if 0 < window < visible else 0  # a sliding window's oldest key
        last, count = visible - 1, visible - first
        padded = (count + 3) // 4 * 4
        table, n0, off0 = tables[seq], first // block_size, first % block_size
        n_last = last // block_size
        # scores[g, c]: key c of the blocks from table[n0] on; the visible ones are off0 .. off0 + count - 1
        # (a score vector's lanes past a block's end are written too: KEYS columns of room)
        keys = attention_vectors.KEYS
        scores = np.empty((group, max((n_last - n0 + 1) * block_size, off0 + padded) + keys), np.float32)
        for nb in range(n0, n_last + 1):
            b, col = table[nb], (nb - n0) * block_size
            if nb + AHEAD <= n_last:
                prefetch(k_f32, k_u16, k_i8, table[nb + AHEAD], kv)
            for c in range(0, block_size, keys):  # every key of the block, the invisible ones' scores unused
                for g0 in range(0, group, attention_vectors.MAX_HEADS):
                    scores_of(q, i, kv * group + g0, min(attention_vectors.MAX_HEADS, group - g0), k_f32, k_u16, k_i8,
                              k_sc, b, kv, c, min(keys, block_size - c), scale, scores, g0, col + c)
        # unsigned indices: with a signed one that LLVM cannot prove non-negative, each access wraps
        # negative indices around, and neither loop vectorized (the softmax took a third of the kernel)
        u0, u1, u2 = np.uint64(off0), np.uint64(off0 + count), np.uint64(off0 + padded)
        for g in range(group):
            best = scores[g, u0]
            for t in range(u0 + np.uint64(1), u1):  # a max: the same whatever order a vectorized loop takes
                best = max(best, scores[g, t])
            for t in range(u0, u1):
                scores[g, t] = _exp(scores[g, t] - best)
            for t in range(u1, u2):
                scores[g, t] = 0
        # the weights' sums in an order fixed by code (a summing loop of its own would be vectorized
        # in some callers and not in others: the fused layer's team and the parallel kernel must give
        # the same bits; the four-row loop below takes its sums four at a time)
        total = np.zeros(group, np.float32)
        acc = np.zeros((group, hd), np.float32)
        if hd % attention_vectors.VALUES == 0:
            for g in range(group):
                total[g] = attention_vectors.row_sum(scores, g, off0, count)
            for nb in range(n0, n_last + 1):
                if nb + AHEAD <= n_last:
                    prefetch(v_f32, v_u16, v_i8, table[nb + AHEAD], kv)
                lo, hi = off0 if nb == n0 else 0, last - nb * block_size + 1 if nb == n_last else block_size
                for g0 in range(0, group, attention_vectors.MAX_HEADS):
                    values_of(v_f32, v_u16, v_i8, v_sc, table[nb], kv, lo, hi, scores, (nb - n0) * block_size, g0,
                              min(attention_vectors.MAX_HEADS, group - g0), acc)
            for g in range(group):
                inv = np.float32(1) / total[g]
                for d in range(hd):
                    out[i, kv * group + g, d] = acc[g, d] * inv
            return
        nb, off = n0, off0
        for t in range(first, visible, 4):
            b0, o0, b1, o1, b2, o2, b3, o3 = _four_rows(table, nb, off, block_size, last - t)
            nb, off = _carried(nb, off + 4, block_size)
            j = t - first + off0
            for g in range(group):
                p0, p1, p2, p3 = scores[g, j], scores[g, j + 1], scores[g, j + 2], scores[g, j + 3]
                total[g] += (p0 + p1) + (p2 + p3)
                add_four(acc, g, p0, p1, p2, p3, v_f32, v_u16, v_i8, v_sc, kv, b0, o0, b1, o1, b2, o2, b3, o3)
        for g in range(group):
            inv = np.float32(1) / total[g]
            for d in range(hd):
                out[i, kv * group + g, d] = acc[g, d] * inv

    return attend


_ATTEND_F32, _ATTEND_F16, _ATTEND_BF16, _ATTEND_Q8_0 = (_attend_for(m) for m in (_F32, _F16, _BF16, _Q8_0))


_KERNELS = Twin(_paged_attention)


def paged_attention(q: np.ndarray, k: KVLayerStore, v: KVLayerStore, tables: np.ndarray, token_seq: np.ndarray,
                    positions: np.ndarray, scale: float, window: int = 0) -> np.ndarray:
    """Causal GQA attention of q [n, hq, hd]: token i belongs to sequence token_seq[i], sits at
    positions[i] and sees that sequence's keys 0..positions[i] (the last `window` of them where
    window > 0), found through tables[seq] (block ids).
    """
    if not k.keys or v.keys:
        raise ValueError("paged_attention takes a key store (keys=True) as k and a value store as v")
    out = np.empty_like(q)
    context = int(positions[-1]) + 1  # the last token's context stands for the step's (cheap)
    work = q.size * 2 * (min(context, window) if window > 0 else context)
    _KERNELS.pick(work)(q, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8, v.scales, k.mode,
                        tables, token_seq, positions, np.int64(window), np.float32(scale), out)
    return out
