"""Paged KV storage on the CPU and the attention kernel that reads it directly, in every KV dtype.

A layer's cache is `n_blocks` blocks of `block_size` token rows, each row [kv_heads, head_dim] stored
as f32, f16 or bf16 bits (uint16), or q8_0 (int8 values plus one f16 scale per 32 values, ggml's
block_q8_0 split into two arrays). Writes convert with kernels/convert.py, the one implementation of
each conversion (numpy: a step writes a few rows); the attention kernel dequantizes key/value rows as it
reads them, so no f32 copy of the cache ever exists: f16 and bf16 rows eight values at a time by the
CPU's own exact widening (`fpext` of `<8 x half>`: F16C's vcvtph2ps on x86; bf16: the bits moved up
16), the same values as the lookup tables built from those conversions, which take a row's last
values when head_dim is no multiple of 8 (a value at a time through the table made an f16 cache's
attention 2.9x slower than an f32 one's at 2048 positions; widened, it runs about as fast, reading
half the bytes), and q8_0 through the f16 table for its scales.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ember.kernels.convert import (_BF16_QUIET, KV_DTYPES, QK8_0, bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits,
                                   f32_to_f16_bits, quantize_q8_0_split)
from ember.kernels.cpu.quant_matmul import four_dots
from ember.kernels.cpu.twin import Twin

MODE = {name: i for i, name in enumerate(KV_DTYPES)}
# The kernel branches on these (numba freezes module-level ints into constants), so it does not
# depend on the order of KV_DTYPES.
_F32, _F16, _BF16, _Q8_0 = MODE["f32"], MODE["f16"], MODE["bf16"], MODE["q8_0"]

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
    def lut(self) -> np.ndarray:
        """The float32 values of this store's 16-bit patterns (bf16, else f16: q8_0's scales are f16s;
        an f32 store reads none), as the attention kernel takes them."""
        return BF16_TABLE if self.mode == _BF16 else F16_TABLE

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


@intrinsic
def _f16_bits(typingctx, v):  # type: ignore[no-untyped-def]
    """float32 -> the bits of the nearest IEEE half, ties to even (LLVM's fptrunc: vcvtps2ph with F16C),
    as convert.f32_to_f16_bits (numpy's astype) rounds: out of range is infinity, a NaN stays NaN."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(v), codegen


@intrinsic
def _f32_bits(typingctx, v):  # type: ignore[no-untyped-def]
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(v), codegen


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
    fused layers store their rows with it; q8_0 rows are stored by write alone)."""
    if mode == _F32:
        f32[blk, off] = row
        return
    dst = u16[blk, off]
    for h in range(row.shape[0]):
        for j in range(row.shape[1]):
            dst[h, j] = _f16_bits(row[h, j]) if mode == _F16 else _bf16_bits(row[h, j])


def _widen8(bf16: bool):  # type: ignore[no-untyped-def]
    """An intrinsic (bits, i, out, j): out[j:j+8] = the f16 (or bf16) values of bits[i:i+8], exactly."""
    def typer(typingctx, bits, i, out, j):  # type: ignore[no-untyped-def]
        if not (bits == types.Array(types.uint16, 1, "C") and out == types.Array(types.float32, 1, "C")
                and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
            return None

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            src, dst = (context.make_array(sig.args[k])(context, builder, args[k]) for k in (0, 2))
            i, j = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (1, 3))
            v8i16, v8f = ir.VectorType(ir.IntType(16), 8), ir.VectorType(ir.FloatType(), 8)
            ptr = builder.gep(builder.bitcast(src.data, ir.IntType(16).as_pointer()), [i])
            v = builder.load(builder.bitcast(ptr, v8i16.as_pointer()), align=2)
            if bf16:  # a bf16 is the top half of a float32
                v8i32 = ir.VectorType(ir.IntType(32), 8)
                wide = builder.bitcast(builder.shl(builder.zext(v, v8i32), ir.Constant(v8i32, [16] * 8)), v8f)
            else:
                wide = builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), v8f)
            out = builder.gep(builder.bitcast(dst.data, ir.FloatType().as_pointer()), [j])
            builder.store(wide, builder.bitcast(out, v8f.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(bits, i, out, j), codegen

    typer.__name__ = "_widen_bf16x8" if bf16 else "_widen_f16x8"
    return intrinsic(typer)


_WIDEN_F16, _WIDEN_BF16 = _widen8(False), _widen8(True)


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
        bits, whole = s_u16[blk, off, h], hd - hd % 8
        if mode == _BF16:
            for j in range(0, whole, 8):
                _WIDEN_BF16(bits, j, out, j)
        else:
            for j in range(0, whole, 8):
                _WIDEN_F16(bits, j, out, j)
        for j in range(whole, hd):
            out[j] = lut[bits[j]]


def _paged_attention(q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, lut,  # type: ignore[no-untyped-def]
                     tables, token_seq, positions, window, scale, out):
    # One task per (token, KV head): each key and value row is read (and decoded) once for all the
    # query heads that share it (GQA), and f32 rows are read in place.
    kv_heads = max(k_f32.shape[2], k_u16.shape[2], k_i8.shape[2])
    for task in prange(q.shape[0] * kv_heads):  # int64: prange's index is unsigned, a second signature
        attention_task(np.int64(task), q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, lut, tables, token_seq,
                       positions, window, scale, out)


@njit(fastmath=True, nogil=True, cache=True)
def attention_task(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, lut,  # type: ignore[no-untyped-def]
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
    batch. An f32 cache is read in place by code of its own: rows that may come from the cache or
    from a decoding scratch buffer made the loops as slow as one key at a time. The other dtypes have
    code of their own each too: with the mode a branch in every row's decoding, an f16 cache's
    attention took twice as long with its rows in cache (231 -> 113 us, 1536 positions, 6 query heads
    on 2 KV heads, 2 threads) and 1.5x with them in memory (497 -> 333 us)."""
    if mode == _F32:
        _ATTEND_F32(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, lut, tables, token_seq, positions,
                    window, scale, out)
    elif mode == _F16:
        _ATTEND_F16(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, lut, tables, token_seq, positions,
                    window, scale, out)
    elif mode == _BF16:
        _ATTEND_BF16(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, lut, tables, token_seq, positions,
                     window, scale, out)
    else:
        _ATTEND_Q8_0(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, lut, tables, token_seq, positions,
                     window, scale, out)


def _attend_for(mode: int):  # type: ignore[no-untyped-def]
    """attention_task's body for a store of `mode`, its rows read in place (f32) or decoded into a
    scratch buffer (`mode` is a constant of the compiled code: no variant branches on it)."""
    in_place = mode == _F32

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def four_rows(s_f32, s_u16, s_i8, s_scales, tables, seq, t, last, block_size, kv, lut, scratch):  # type: ignore[no-untyped-def]
        """The stored rows of positions t .. t + 3 (past `last`: the row of `last` again) as float32."""
        t1, t2, t3 = min(t + 1, last), min(t + 2, last), min(t + 3, last)
        b0, b1, b2, b3 = tables[seq, t // block_size], tables[seq, t1 // block_size], tables[seq, t2 // block_size], \
            tables[seq, t3 // block_size]
        o0, o1, o2, o3 = t % block_size, t1 % block_size, t2 % block_size, t3 % block_size
        if in_place:
            return s_f32[b0, o0, kv], s_f32[b1, o1, kv], s_f32[b2, o2, kv], s_f32[b3, o3, kv]
        _load_row(s_f32, s_u16, s_i8, s_scales, mode, b0, o0, kv, lut, scratch[0])
        _load_row(s_f32, s_u16, s_i8, s_scales, mode, b1, o1, kv, lut, scratch[1])
        _load_row(s_f32, s_u16, s_i8, s_scales, mode, b2, o2, kv, lut, scratch[2])
        _load_row(s_f32, s_u16, s_i8, s_scales, mode, b3, o3, kv, lut, scratch[3])
        return scratch[0], scratch[1], scratch[2], scratch[3]

    @njit(inline="always", fastmath=True, nogil=True, cache=True)
    def attend(task, q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, lut,  # type: ignore[no-untyped-def]
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
        scratch = np.empty((4, hd), np.float32)
        for t in range(first, visible, 4):
            k0, k1, k2, k3 = four_rows(k_f32, k_u16, k_i8, k_sc, tables, seq, t, last, block_size, kv, lut, scratch)
            j = t - first
            for g in range(group):
                s0, s1, s2, s3 = four_dots(q[i, kv * group + g], k0, k1, k2, k3)
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
        for t in range(first, visible, 4):
            v0, v1, v2, v3 = four_rows(v_f32, v_u16, v_i8, v_sc, tables, seq, t, last, block_size, kv, lut, scratch)
            j = t - first
            for g in range(group):
                p0, p1, p2, p3, a = scores[g, j], scores[g, j + 1], scores[g, j + 2], scores[g, j + 3], acc[g]
                total[g] += (p0 + p1) + (p2 + p3)
                for d in range(hd):
                    a[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d])
        for g in range(group):
            o, a, inv = out[i, kv * group + g], acc[g], np.float32(1) / total[g]
            for d in range(hd):
                o[d] = a[d] * inv

    return attend


_ATTEND_F32, _ATTEND_F16, _ATTEND_BF16, _ATTEND_Q8_0 = (_attend_for(m) for m in (_F32, _F16, _BF16, _Q8_0))


@njit(inline="always", fastmath=True, nogil=True, cache=True)
def _exp(x):  # type: ignore[no-untyped-def]
    """e^x for x <= 0 (a softmax's shifted scores), 0 from -87 down: 2^k times a degree-6 polynomial
    for 2^f (Cephes exp2f's), f in (-0.5, 0.5]. Arithmetic only, so the softmax loop vectorizes
    (libm's expf went one score at a time: a third of a prefill's attention). Rounding x * log2(e)
    to float32 makes the relative error about |x| * 6e-8 (3.8e-6 at -87; measured against float64
    exp), so the absolute error stays below 4e-8: far below what a weight's rounding in the value
    sums costs."""
    t = max(x, np.float32(-87.0)) * np.float32(1.4426950408889634)
    k = np.int32(t - np.float32(0.5))  # rounds to nearest for t <= 0 (int() truncates toward 0)
    f = t - np.float32(k)
    p = np.float32(1.535336188319500e-4)
    p = p * f + np.float32(1.339887440266574e-3)
    p = p * f + np.float32(9.618437357674640e-3)
    p = p * f + np.float32(5.550332471162809e-2)
    p = p * f + np.float32(2.402264791363012e-1)
    p = p * f + np.float32(6.931472028550421e-1)
    return (p * f + np.float32(1.0)) * _pow2(k) if x > np.float32(-87.0) else np.float32(0.0)


@intrinsic
def _pow2(typingctx, k):  # type: ignore[no-untyped-def]
    """float32 2^k for an int32 k in [-126, 127]: the exponent bits, bitcast (numba has no bitcast)."""
    if not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        biased = builder.add(builder.trunc(args[0], i32) if args[0].type.width > 32 else args[0], ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(k), codegen


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
    _KERNELS.pick(work)(q, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8, v.scales, k.mode, k.lut,
                        tables, token_seq, positions, np.int64(window), np.float32(scale), out)
    return out
