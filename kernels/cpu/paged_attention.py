"""Paged KV storage on the CPU and the attention kernel that reads it directly, in every KV dtype.

A layer's cache is `n_blocks` blocks of `block_size` token rows, each row [kv_heads, head_dim] stored
as f32, f16 or bf16 bits (uint16), or q8_0 (int8 values plus one f16 scale per 32 values, ggml's
block_q8_0 split into two arrays). Writes convert with kernels/convert.py, the one implementation of
each conversion (numpy: a step writes a few rows); the attention kernel reads key/value rows where
they are stored, in every dtype, so no f32 copy of the cache ever exists: its dot products load f16
and bf16 values through the CPU's own exact widening (`fpext` of half: F16C's vcvtph2ps on x86,
vectorized with the loop; bf16: the bits moved up 16), and q8_0 values as integers, each 32-value
group's sum times its f16 scale. Measured on the 2-core Zen 5 VM, 1536 positions, 12 query heads on
4 KV heads of 64, per layer with 12 layers' caches taking turns (so read from memory): f32 174 us,
f16 62 us, bf16 62 us, q8_0 73 us (widened into a scratch row first, as before 2026-11-29: f16 72 us,
q8_0 196 us).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ember.kernels.convert import _BF16_QUIET, KV_DTYPES, QK8_0, f32_to_bf16_bits, f32_to_f16_bits, quantize_q8_0_split
from ember.kernels.cpu.int8_dots import _round_half_away
from ember.kernels.cpu.dense import exp_nonpositive as _exp
from ember.kernels.cpu.twin import Twin

MODE = {name: i for i, name in enumerate(KV_DTYPES)}
# The kernel branches on these (numba freezes module-level ints into constants), so it does not
# depend on the order of KV_DTYPES.
_F32, _F16, _BF16, _Q8_0 = MODE["f32"], MODE["f16"], MODE["bf16"], MODE["q8_0"]


@dataclass(eq=False)  # a store is itself, not its arrays' values: hashed by identity (a weak key)
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
def store_row(mode, row, f32, u16, blk, off):  # type: ignore[no-untyped-def]
    """A K or V row (float32 [kv_heads, head_dim]) into an f32, f16 or bf16 store at (blk, off), in
    compiled code, converted bit for bit as KVLayerStore.write converts it (kernels/convert.py; the
    fused layers store their rows with it; q8_0 rows: store_row_q8_0)."""
    if mode == _F32:
        f32[blk, off] = row
        return
    dst = u16[blk, off]
    for h in range(row.shape[0]):
        for j in range(row.shape[1]):
            dst[h, j] = _f16_bits(row[h, j]) if mode == _F16 else _bf16_bits(row[h, j])


@njit(inline="always", cache=True, nogil=True)
def store_row_q8_0(row, i8, scales, blk, off):  # type: ignore[no-untyped-def]
    """A K or V row (float32 [kv_heads, head_dim]) into a q8_0 store at (blk, off), in compiled code,
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
            scales[blk, off, h, b] = _f16_bits(d)
            for j in range(b * QK8_0, (b + 1) * QK8_0):
                v = row[h, j] * inv
                i8[blk, off, h, j] = np.int8(_round_half_away(v)) if np.isfinite(v) else np.int8(0)


@njit(inline="always", cache=True, nogil=True)
def store_kv_rows(mode, k_row, v_row, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, blk, off):  # type: ignore[no-untyped-def]
    """A token's K and V rows into their stores at (blk, off), in any KV dtype, as KVLayerStore.write
    stores them: the fused layers' K/V write."""
    if mode == _Q8_0:
        store_row_q8_0(k_row, k_i8, k_sc, blk, off)
        store_row_q8_0(v_row, v_i8, v_sc, blk, off)
    else:
        store_row(mode, k_row, k_f32, k_u16, blk, off)
        store_row(mode, v_row, v_f32, v_u16, blk, off)


def _paged_attention(q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode,  # type: ignore[no-untyped-def]
                     tables, token_seq, positions, window, scale, out):
    # One task per (token, KV head): each key and value row is read (and decoded) once for all the
    # query heads that share it (GQA). The threads take contiguous shares of the loop, and a prompt
    # chunk's later tokens see more keys: the tokens are taken from both ends in turn (0, n-1, 1,
    # n-2, ...), so that each share holds early and late ones alike.
    kv_heads = max(k_f32.shape[2], k_u16.shape[2], k_i8.shape[2])
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

    Keys and values go four at a time: four scores from one pass over the query head (four
    independent vector sums, not one dot's horizontal sum per key), and each pass over the value
    rows adds four weighted rows into the accumulators; 1.6-1.8x faster than one at a time on a
    256-token prompt chunk at positions 256-511 and on 8 decode tokens. A token's last group may
    reach past its last key: those slots repeat the last key and get weight 0. How keys are grouped
    depends only on the token's own position, so a token's output never depends on the rest of its
    batch. Each dtype has code of its own: with the mode a branch in every row's decoding, an f16
    cache's attention took twice as long with its rows in cache (231 -> 113 us, 1536 positions, 6
    query heads on 2 KV heads, 2 threads) and 1.5x with them in memory (497 -> 333 us). Rows are
    addressed by index, never as array views (a view costs reference counting), and found block by
    block with no division (one per row cost a tenth of the time at 1536 positions)."""
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
    branches on it), its rows read in place: f16 and bf16 values widened as the dot products load
    them, q8_0 values scaled once per 32-value group of each dot."""
    width = QK8_0 if mode == _Q8_0 else 0  # values per scale; 0: the whole row, unscaled

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def value(s_f32, s_u16, s_i8, b, o, kv, k):  # type: ignore[no-untyped-def]
        if mode == _F32:
            return s_f32[b, o, kv, k]
        if mode == _F16:
            return _f16_value(s_u16[b, o, kv, k])
        if mode == _BF16:
            return _bf16_value(s_u16[b, o, kv, k])
        return np.float32(s_i8[b, o, kv, k])

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def group_scale(s_sc, b, o, kv, group):  # type: ignore[no-untyped-def]
        return _f16_value(s_sc[b, o, kv, group]) if mode == _Q8_0 else np.float32(1)

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def four_scores(q, i, h, s_f32, s_u16, s_i8, s_sc, kv, b0, o0, b1, o1, b2, o2, b3, o3):  # type: ignore[no-untyped-def]
        """q[i, h] . the four stored rows, in four independent vector sums (one pass over q)."""
        hd = q.shape[2]
        w = width if width else hd
        a0 = a1 = a2 = a3 = np.float32(0)
        for grp in range(hd // w):
            c0 = c1 = c2 = c3 = np.float32(0)
            for k in range(grp * w, grp * w + w):
                x = q[i, h, k]
                c0 += x * value(s_f32, s_u16, s_i8, b0, o0, kv, k)
                c1 += x * value(s_f32, s_u16, s_i8, b1, o1, kv, k)
                c2 += x * value(s_f32, s_u16, s_i8, b2, o2, kv, k)
                c3 += x * value(s_f32, s_u16, s_i8, b3, o3, kv, k)
            a0 += c0 * group_scale(s_sc, b0, o0, kv, grp)
            a1 += c1 * group_scale(s_sc, b1, o1, kv, grp)
            a2 += c2 * group_scale(s_sc, b2, o2, kv, grp)
            a3 += c3 * group_scale(s_sc, b3, o3, kv, grp)
        return a0, a1, a2, a3

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def add_four(acc, g, p0, p1, p2, p3, s_f32, s_u16, s_i8, s_sc, kv, b0, o0, b1, o1, b2, o2, b3, o3):  # type: ignore[no-untyped-def]
        """acc[g] += p0 row0 + p1 row1 + p2 row2 + p3 row3, in a fixed order."""
        hd = acc.shape[1]
        w = width if width else hd
        for grp in range(hd // w):
            w0, w1 = p0 * group_scale(s_sc, b0, o0, kv, grp), p1 * group_scale(s_sc, b1, o1, kv, grp)
            w2, w3 = p2 * group_scale(s_sc, b2, o2, kv, grp), p3 * group_scale(s_sc, b3, o3, kv, grp)
            for d in range(grp * w, grp * w + w):
                acc[g, d] += (w0 * value(s_f32, s_u16, s_i8, b0, o0, kv, d) + w1 * value(s_f32, s_u16, s_i8, b1, o1, kv, d)) \
                    + (w2 * value(s_f32, s_u16, s_i8, b2, o2, kv, d) + w3 * value(s_f32, s_u16, s_i8, b3, o3, kv, d))

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def attend(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc,  # type: ignore[no-untyped-def]
               tables, token_seq, positions, window, scale, out):
        n, hq, hd = q.shape
        block_size = max(k_f32.shape[1], k_u16.shape[1], k_i8.shape[1])
        kv_heads = max(k_f32.shape[2], k_u16.shape[2], k_i8.shape[2])
        group = hq // kv_heads
        i, kv = task // kv_heads, task % kv_heads
        seq, visible = token_seq[i], positions[i] + 1
        first = visible - window if 0 < window < visible else 0  # a sliding window's oldest key
        last, count = visible - 1, visible - first
        padded = (count + 3) // 4 * 4
        scores = np.empty((group, padded), np.float32)
        table, n0, off0 = tables[seq], first // block_size, first % block_size
        nb, off = n0, off0
        for t in range(first, visible, 4):
            b0, o0, b1, o1, b2, o2, b3, o3 = _four_rows(table, nb, off, block_size, last - t)
            nb, off = _carried(nb, off + 4, block_size)
            j = t - first
            for g in range(group):
                s0, s1, s2, s3 = four_scores(q, i, kv * group + g, k_f32, k_u16, k_i8, k_sc, kv,
                                             b0, o0, b1, o1, b2, o2, b3, o3)
                scores[g, j], scores[g, j + 1] = s0 * scale, s1 * scale
                scores[g, j + 2], scores[g, j + 3] = s2 * scale, s3 * scale
        for g in range(group):
            best = scores[g, 0]
            for t in range(1, count):  # a max: the same whatever order a vectorized loop takes
                best = max(best, scores[g, t])
            for t in range(count):
                scores[g, t] = _exp(scores[g, t] - best)
            for t in range(count, padded):
                scores[g, t] = 0
        # the weights' sums are taken in the value pass, four at a time in a fixed order: a summing
        # loop of its own would be vectorized in some callers and not in others (the fused layer's
        # team and the parallel kernel must give the same bits)
        total = np.zeros(group, np.float32)
        acc = np.zeros((group, hd), np.float32)
        nb, off = n0, off0
        for t in range(first, visible, 4):
            b0, o0, b1, o1, b2, o2, b3, o3 = _four_rows(table, nb, off, block_size, last - t)
            nb, off = _carried(nb, off + 4, block_size)
            j = t - first
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
    out = np.empty_like(q)
    context = int(positions[-1]) + 1  # the last token's context stands for the step's (cheap)
    work = q.size * 2 * (min(context, window) if window > 0 else context)
    _KERNELS.pick(work)(q, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8, v.scales, k.mode,
                        tables, token_seq, positions, np.int64(window), np.float32(scale), out)
    return out
