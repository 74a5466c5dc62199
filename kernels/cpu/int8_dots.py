"""Integer dot products of quantized weight rows with int8-quantized activations: the decode kernels.

This module owns the activation quantizers and the tiles (one weight row x 1 to TILE_TOKENS tokens)
that quant_matmul.py's decode-row kernels are made of, for every block type (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS). It is llama.cpp's approach: x is quantized once
per matmul, into ggml's q8_0 against the 32-value block types (32 int8 values and one f16 scale, bit
for bit as kernels/convert.py quantizes) and into 256-value blocks with one float32 scale against
K-quants and IQ4_XS (convert.quantize_q8_k_split, after ggml's q8_K), and every 32 weight quants meet
32 activation quants in integer arithmetic instead of being widened to float32.

Why the kernels are LLVM IR (numba intrinsics) and look the way they do (measured on the 2-core Zen 4
VM):
- numba widens small-int arithmetic to int64 and has no vector types; in IR a 32-value chunk is one
  <32 x i8> load per operand and its 32 products are summed by fours into 8 exact int32 lanes:
  vpdpbusd with AVX-512 VNNI, vpmaddubsw + vpmaddwd with AVX2 (llama.cpp's instructions), portable
  IR elsewhere. Every path gives the same integers (a test runs each). Signed Q8_0 weights: with VNNI
  one xor makes them unsigned (q + 128) and vpdpbusd starts from -128 x the activation's 4-value
  sums (quad_offsets, once per call), instead of llama.cpp's two vpsignb per block (with AVX2 they
  stay: vpmaddubsw would saturate on q + 128).
- Q6_K (most of a Q4_K_M file's bytes after Q4_K: its head, half its down and value projections):
  its chunks' unsigned quants (q + 32) meet x in pair sums times their 16-bit scales (vpmaddubsw,
  then vpdpwssd), as Q4_K's do, and the stored offset comes off once per super-block, its sixteen
  scales times the activation's 16-value sums (one vpmaddwd: _sixteen_offsets): 2 multiplies a
  chunk where vpdpbusd from the offsets and a vpmulld by the scale took 3. On the 2-core Zen 4 VM,
  2 threads, both kernels in one process: one token 2048 x 768 27.4 -> 26.1 us, 32000 x 768 463 ->
  397 us; four tokens 83 -> 65 and 1309 -> 1011 us (docs/runtime.md). Q3_K's offset of 4 comes off
  the same way (one token 2048 x 768 40.9 -> 35.1 us, four tokens 92 -> 75 us).
- One-token Q4_K and Q6_K tiles with AVX-512 (_WIDE) dot two neighbouring chunks per 512-bit
  vpmaddubsw and vpdpwssd (_paired_dots), and unpack a super-block's chunks 64 bytes at a time; the
  two chunks' lanes are added at the end, the same integers. One thread, alternated in one process on
  the Zen 4 VM, 256 x 512 to 32000 x 768: Q6_K 1.14-1.20x faster, Q4_K 1.03-1.13x (Q4_K's 6-bit
  scales are unpacked in vector lanes too, _k4_levels). Four-token tiles keep 256-bit chunks: 512-bit
  pairs ran them 2-8% slower, as did pairs of Q8_0 blocks (two blocks' quants are 34 bytes apart)
  one token.
- Q8_0: a unit's 4 blocks' int32 lanes are summed in integers (shuffle-adds, as vphaddd), so their
  4 exact block dots become float together and meet their 4 (weight scale x activation scale)
  products in one multiply, instead of a broadcast, convert and multiply per block (with the
  offsets: 11.75 -> 8 instructions per block, 2048 x 768 one thread 69 -> 51 us). K-quants: the
  activation has one scale per super-block, so the eight chunks' lanes times their integer sub-block
  scales add up in int32 and become float once per super-block (1.33x faster than a float per
  chunk on Q4_K). Q4_K/Q5_K mins meet the 32-value sums of x_hat (llama.cpp's bsums). The result is
  dequantize(W) @ x_hat to float32 rounding, x_hat being x after its round trip.
- A tile walks one weight row at a time: two rows interleaved in one loop halved a DRAM-bound matvec
  (19 -> 9 GB/s on one core; measured again with these tiles, 32000 x 768 Q8_0: 1.06 -> 2.9 ms),
  the hardware prefetcher following one stream best. Four tokens per tile reuse each unpacked
  weight chunk four times (batched decode); the one-token tile of plain decode takes two rows, one
  after the other, sharing the tile's fixed cost.
- Float operations are emitted in a fixed order without fast-math flags, and the drivers are compiled
  without fast-math: with it LLVM reassociated each tile shape its own way, and a token's result
  depended on how many tokens shared its step. Now every (row, token) result is bit-identical
  whatever the batch, the tile shape or the serial/parallel variant.
- Loads are unaligned (align 1): GGUF rows are only 2-byte aligned for Q8_0 (34-byte blocks).
- The newer types reuse these paths: a stored offset (Q4_0 8, Q5_0 16) comes off
  through the quad_offsets, shifted (exactly: powers of two) from the activation's own offset; Q4_1
  and Q5_1 add d*q + m, their -m meeting the block sums as Q4_K's mins do; Q2_K's mins, one per 16
  values, meet the 4-value sums in int32 and become float once per super-block; the IQ4 types' codes
  become signed levels with vpshufb (a select chain on the portable path).
"""
from __future__ import annotations

import os

import numpy as np
import llvmlite.binding as llvm
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ember.kernels.tensor_types import IQ4_LEVELS

__all__ = ["quantize_activation", "quantize_activation_k", "quad_offsets", "offsets_width", "Q8_0_OFFSET", "Q6_K_OFFSET",
           "unpack_k4_levels", "TILE_TOKENS", "TILE_SIZES", "ROW_PAIR", "Q8_0_TILES", "Q4_0_TILES", "Q4_1_TILES",
           "Q5_0_TILES", "Q5_1_TILES", "IQ4_NL_TILES", "Q2_K_TILES", "Q3_K_TILES", "Q4_K_TILES", "Q5_K_TILES",
           "Q6_K_TILES", "IQ4_XS_TILES"]

QK = 32  # values per q8_0 activation block (ggml's QK8_0), and per sub-block sum
QK_K = 256  # values per activation block against K-quant weights (one super-block)
Q8_0_OFFSET = 128  # quad_offsets' offset for the q8_0 activations (Q8_0 weights, sign-flipped)
Q6_K_OFFSET = 32  # and for the q8_K ones (Q6_K's stored offset; Q4_K/Q5_K have none and ignore them)
Q3_K_OFFSET = 4  # Q3_K's stored offset: taken off per super-block, as Q6_K's (_sixteen_offsets)

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V32I8 = ir.VectorType(_I8, 32)
_V8F = ir.VectorType(_F32, 8)
_Q8_0_LANES = 4  # Q8_0 blocks per unit: one float lane each


# --------------------------------------------------------------------------------------------------
# the activation quantizer (ggml's quantize_row_q8_0_ref, bit for bit)
# --------------------------------------------------------------------------------------------------
@intrinsic
def _round_f16(typingctx, v):
    """float32 v rounded to the nearest IEEE half (ties to even), widened back: the value of the
    f16 scale ggml stores."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), _F32)

    return types.float32(v), codegen


@njit(inline="always", cache=True, nogil=True)
def _round_half_away(v):
    """C's roundf on a float32: halves away from zero."""
    t = np.float32(np.trunc(v))
    if abs(v - t) >= np.float32(0.5):
        t += np.float32(1) if v > 0 else np.float32(-1)
    return t


@njit(cache=True, nogil=True)  # no fast-math: bit-exact with kernels/convert.py
def quantize_activation(x, xq, xd, xs):
    """x float32 [n] (n a multiple of 32) -> ggml's q8_0: xq int8 [n], xd float32 [n/32] (the f16
    scales' values) and xs float32 [n/32] (xd * the sum of each block's quants: the block sums of
    x_hat). Block b: d = max|x| / 127, q = roundf(x / d) with 1/d computed before d is rounded to
    f16, as ggml does; a value whose x * (1/d) is not finite is stored as 0 (kernels/convert.py)."""
    _quantize_blocks(x, xq, xd, xs, QK, True)


@njit(cache=True, nogil=True)
def quantize_activation_k(x, xq, xd, xs):
    """The activations of K-quant weights (convert.quantize_q8_k_split): one float32 scale per 256
    values in xd [n/256]; xs [n/32] as above (per 32 values, the sub-blocks' mins need them)."""
    _quantize_blocks(x, xq, xd, xs, QK_K, False)


@njit(inline="always", cache=True, nogil=True)
def offsets_width(cols, k_quants):
    """Columns of quad_offsets' xc for cols activation values: n/4 quads, and for q8_K activations
    (k_quants) the 16-value sums after them."""
    return cols // 4 + (cols // 32 if k_quants else 0)


@njit(cache=True, nogil=True)
def quad_offsets(xq, xc, offset):
    """xc int32 [n/4]: -offset * the sum of each 4 consecutive quants of xq int8 [n]. A weight stored
    as unsigned u = q + offset meets x in one vpdpbusd that starts from these: sum(u * x) - offset *
    sum(x) = q . x (Q8_0 weights flipped to q + 128, Q6_K's stored q + 32). Where xc is wider
    (offsets_width for q8_K activations), its n/32 words after the quads hold the sums of each 16
    consecutive quants as int16 pairs, little-endian (|sum| <= 2032): Q6_K's and Q3_K's tiles take
    their stored offset off once per super-block with them (_sixteen_offsets), not once per chunk."""
    chunks = xq.shape[0] // QK
    sixteens = xq.shape[0] // 4 if xc.shape[0] > xq.shape[0] // 4 else -1
    for c in range(chunks):
        _chunk_offsets(xq, xc, c, offset, sixteens)


@njit(inline="always", cache=True, nogil=True)
def _quantize_blocks(x, xq, xd, xs, block, f16_scale):
    """Each block in vector lanes (_abs_max, _quantize_chunk). A block holding an inf or a NaN takes
    its max from the scalar loop (_abs_max_scalar), whose max defines it (a NaN is passed over); the
    chunks then zero what is not finite lane by lane, as the scalar loop did."""
    for b in range(x.shape[0] // block):
        amax = np.float32(0)
        for s in range(block // QK):
            amax = max(amax, _abs_max(x, block * b + QK * s))
        if amax == np.inf:
            amax = _abs_max_scalar(x, block * b, block)
        d = amax / np.float32(127)
        inv = np.float32(0) if d == 0 else np.float32(1) / d
        xd[b] = _round_f16(d) if f16_scale else d
        for s in range(block // QK):
            xs[b * (block // QK) + s] = xd[b] * np.float32(_quantize_chunk(x, xq, block * b + QK * s, inv))


@njit(inline="always", cache=True, nogil=True)
def _abs_max_scalar(x, first, count):
    amax = np.float32(0)
    for j in range(first, first + count):
        amax = max(amax, abs(x[j]))
    return amax


# The quantizer's vector steps, 32 values at a time. Scalar, numba's loops did not vectorize (a
# branch-free rewrite neither): 2.15 us per 2048 values (q8_0) on the Zen 4 VM.
_V32F = ir.VectorType(_F32, 32)
_INF = float("inf")


def _element_ptr(context, builder, ty, array, index, elem):
    """A pointer (to `elem`) at element `index` of a 1-D contiguous array."""
    data = context.make_array(ty)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [_i64(builder, index)], inbounds=True), elem.as_pointer())


def _reduce(builder, v, op):
    """v's lanes combined pairwise by op (a builder method, or a function of it), halves first."""
    n = v.type.count
    while n > 1:
        v = op(_pick(builder, v, range(n // 2)), _pick(builder, v, range(n // 2, n)))
        n //= 2
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def _abs_max(typingctx, x, at):
    """max |x[at..at+31]| of a float32 array, or inf if one of them is inf or NaN. Over finite
    values a max is the same in any order, so the lanes' tree gives the scalar loop's value."""
    if x != types.Array(types.float32, 1, "C") or not isinstance(at, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[1], _V32F), align=4)
        a = _call(builder, "llvm.fabs.v32f32", _V32F, v)
        odd = builder.fcmp_unordered(">=", a, ir.Constant(_V32F, [_INF] * 32))  # inf, or NaN
        any_odd = builder.icmp_unsigned("!=", builder.bitcast(odd, _I32), ir.Constant(_I32, 0))

        def larger(p, q):
            return builder.select(builder.fcmp_ordered(">", p, q), p, q)

        return builder.select(any_odd, ir.Constant(_F32, _INF), _reduce(builder, a, larger))

    return types.float32(x, at), codegen


@intrinsic
def _quantize_chunk(typingctx, x, xq, at, inv):
    """xq[at..at+31] = roundf(x * inv) (0 where x * inv is not finite) -> the sum of those 32 quants,
    the scalar loop's operations lane by lane (llvm.round is roundf: halves away from zero). A lane
    that is not finite converts to poison, which the select drops."""
    if (x != types.Array(types.float32, 1, "C") or xq != types.Array(types.int8, 1, "C")
            or not isinstance(at, types.Integer) or inv != types.float32):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_element_ptr(context, builder, sig.args[0], args[0], args[2], _V32F), align=4)
        p = builder.fmul(v, _splat(builder, args[3], 32))
        finite = builder.fcmp_ordered("<", _call(builder, "llvm.fabs.v32f32", _V32F, p),
                                      ir.Constant(_V32F, [_INF] * 32))
        v32i32 = ir.VectorType(_I32, 32)
        q = builder.fptosi(_call(builder, "llvm.round.v32f32", _V32F, p), v32i32)
        q = builder.select(finite, q, ir.Constant(v32i32, [0] * 32))
        builder.store(builder.trunc(q, _V32I8), _element_ptr(context, builder, sig.args[1], args[1], args[2], _V32I8),
                      align=1)
        return _reduce(builder, q, builder.add)

    return types.int32(x, xq, at, inv), codegen


@intrinsic
def _chunk_offsets(typingctx, xq, xc, c, offset, sixteens):
    """quad_offsets for chunk c (values 32c..32c+31): xc[8c..8c+7] = -offset * each quad's sum and,
    if sixteens >= 0, xc[sixteens + c] = the chunk's two 16-value sums as int16 pair. The quad sums
    are _u8_s8_quads of ones and the quants (exact on every instruction path)."""
    if (xq != types.Array(types.int8, 1, "C") or xc != types.Array(types.int32, 1, "C")
            or not all(isinstance(a, types.Integer) for a in (c, offset, sixteens))):
        return None

    def codegen(context, builder, sig, args):
        c = _i64(builder, args[2])
        q = builder.load(_element_ptr(context, builder, sig.args[0], args[0], builder.mul(c, ir.Constant(_I64, QK)),
                                      _V32I8), align=1)
        quads = _u8_s8_quads(builder, _splat_i8(1), q)
        v8i32 = ir.VectorType(_I32, 8)
        scale = builder.trunc(builder.neg(_i64(builder, args[3])), _I32)
        scaled = builder.mul(quads, builder.shuffle_vector(
            builder.insert_element(ir.Constant(v8i32, None), scale, ir.Constant(_I32, 0)), ir.Constant(v8i32, None),
            ir.Constant(v8i32, [0] * 8)))
        builder.store(scaled, _element_ptr(context, builder, sig.args[1], args[1], builder.mul(c, ir.Constant(_I64, 8)),
                                           v8i32), align=4)
        sixteens = _i64(builder, args[4])
        with builder.if_then(builder.icmp_signed(">=", sixteens, ir.Constant(_I64, 0))):
            halves = [_reduce(builder, _pick(builder, quads, range(h * 4, h * 4 + 4)), builder.add) for h in (0, 1)]
            pair = builder.or_(builder.and_(halves[0], ir.Constant(_I32, 0xFFFF)),
                               builder.shl(halves[1], ir.Constant(_I32, 16)))
            builder.store(pair, _element_ptr(context, builder, sig.args[1], args[1], builder.add(sixteens, c), _I32),
                          align=4)
        return context.get_dummy_value()

    return types.none(xq, xc, c, offset, sixteens), codegen


# --------------------------------------------------------------------------------------------------
# IR building blocks
# --------------------------------------------------------------------------------------------------
def _i64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def _at(builder, ptr, offset):
    """ptr + offset bytes (offset an int or an i64 value)."""
    off = ir.Constant(_I64, offset) if isinstance(offset, int) else offset
    return builder.gep(ptr, [off], inbounds=True)


def _load_i8x32(builder, ptr):
    return builder.load(builder.bitcast(ptr, _V32I8.as_pointer()), align=1)


def _load_f16(builder, ptr):
    bits = builder.load(builder.bitcast(ptr, _I16.as_pointer()), align=1)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)


def _load_f32x8(builder, ptr):
    return builder.load(builder.bitcast(ptr, _V8F.as_pointer()), align=4)


def _splat_i8(value, n=32):
    return ir.Constant(ir.VectorType(_I8, n), [value] * n)


def _splat(builder, f, n):
    v = builder.insert_element(ir.Constant(ir.VectorType(_F32, n), None), f, ir.Constant(_I32, 0))
    return _pick(builder, v, [0] * n)


def _pick(builder, v, lanes):
    """A vector of v's elements at `lanes` (a shuffle)."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(lanes)), list(lanes)))


def _pair_sums(builder, v, n):
    """<n x i32> -> <n/2 x i32>: the sums of adjacent pairs."""
    return builder.add(_pick(builder, v, range(0, n, 2)), _pick(builder, v, range(1, n, 2)))


# How a chunk's 32 weight quants are stored: SIGNED int8 (Q8_0, the IQ4 levels), UNSIGNED small
# levels (Q4_K 0..15, Q5_K 0..31, Q2_K 0..3, Q4_1, Q5_1), or a positive offset k: unsigned u standing
# for u - k (Q6_K 32, Q5_0 16, Q4_0 8, Q3_K 4).
SIGNED, UNSIGNED = -1, 0

_FEATURES = llvm.get_host_cpu_features()
# x86: u8 x s8 byte products summed in fours by vpdpbusd (AVX-512 VNNI) or vpmaddubsw + vpmaddwd
# (AVX2), llama.cpp's instructions; elsewhere portable IR (sign-extend, multiply, pair sums). Every
# path gives the same integers. EMBER_INT8_PATH=avx2|portable picks a lesser path on a better CPU,
# for tests (tests/test_int8_dots.py runs them, with a fresh numba cache: the cache does not know it).
_PATH = os.environ.get("EMBER_INT8_PATH", "")
_VNNI = bool(_FEATURES.get("avx512vnni", False) and _FEATURES.get("avx512vl", False)) and not _PATH
_AVX2 = bool(_FEATURES.get("avx2", False)) and _PATH != "portable"
# A one-token tile dots Q4_K and Q6_K chunks in neighbouring pairs, 512 bits at a time (_paired_dots):
# Zen 4 splits a 512-bit op in two halves, but a super-block's instructions fall (Q4_K's loop, with its
# scales unpacked in vector lanes: ~85 -> 57). Four-token tiles keep 256-bit chunks: their products
# are the bound there, and the pairs' extra shuffles and lane sums made them 2-8% slower.
_WIDE = _VNNI and bool(_FEATURES.get("avx512bw", False))


def _call(builder, name, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _u8_s8_quads(builder, u, s, start=None):
    """<32 x i8> unsigned u times <32 x i8> signed s -> <8 x i32>: lane j = start[j] + the sum of
    products 4j..4j+3. Exact: |u| <= 128 and |s| <= 127 keep vpmaddubsw's int16 pair sums below
    saturation; with VNNI (no int16 step) u may be up to 255."""
    v8i32, v16i16 = ir.VectorType(_I32, 8), ir.VectorType(_I16, 16)
    if _VNNI:
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8i32,
                     ir.Constant(v8i32, [0] * 8) if start is None else start,
                     builder.bitcast(u, v8i32), builder.bitcast(s, v8i32))
    if _AVX2:
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, u, s)
        quads = _call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, pairs, ir.Constant(v16i16, [1] * 16))
    else:
        wide = ir.VectorType(_I32, 32)
        prod = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
        quads = _pair_sums(builder, _pair_sums(builder, prod, 32), 16)
    return quads if start is None else builder.add(quads, start)


def _chunk_dot(builder, wq, kind, xq, offsets):
    """32 weight quants (stored as `kind`) . 32 activation quants -> <8 x i32>, lane j the exact sum
    of products 4j..4j+3 (every instruction path gives the same integers). offsets: the chunk's
    quad_offsets (<8 x i32>) for the weight's offset (128 for SIGNED, k for an offset kind)."""
    if kind == SIGNED and _VNNI:  # (w + 128) . x - 128 * sum(x): one vpdpbusd from the offsets
        return _u8_s8_quads(builder, builder.xor(wq, _splat_i8(-128)), xq, offsets)
    if kind == SIGNED:  # |w| . (x with w's sign), as llama.cpp does for signed pairs
        if _AVX2:
            v = ir.VectorType(_I8, 32)
            return _u8_s8_quads(builder, _call(builder, "llvm.x86.avx2.psign.b", v, wq, wq),
                                _call(builder, "llvm.x86.avx2.psign.b", v, xq, wq))
        wide = ir.VectorType(_I32, 32)
        prod = builder.mul(builder.sext(wq, wide), builder.sext(xq, wide))
        return _pair_sums(builder, _pair_sums(builder, prod, 32), 16)
    # an offset k: (u - k) . x = u . x - k * sum(x), the offsets being -k * sum(x)
    return _u8_s8_quads(builder, wq, xq, offsets if kind > 0 else None)


def _tree_sum(builder, terms):
    """The sum of terms as a balanced tree, in a fixed order."""
    while len(terms) > 1:
        pairs = [builder.fadd(terms[k], terms[k + 1]) for k in range(0, len(terms) - 1, 2)]
        terms = pairs + (terms[-1:] if len(terms) % 2 else [])
    return terms[0]


def _hsum(builder, v):
    return _reduce(builder, v, builder.fadd)


def _k4_levels(builder, header):
    """The 16 6-bit levels of a Q4_K/Q5_K super-block whose 12 `scales` bytes start at `header`:
    unpack_k4_levels's words in vector lanes, from one 16-byte load (the scales and the first 4
    quant bytes, unused): ~8 instructions where the words' scalar masks and shifts took ~24."""
    v4 = ir.VectorType(_I32, 4)
    v = builder.load(builder.bitcast(header, v4.as_pointer()), align=1)  # words a, b, c (and 4 bytes past)
    words = _pick(builder, v, [0, 2, 1, 2])  # a, c, b, c
    low = builder.and_(builder.lshr(words, ir.Constant(v4, [0, 0, 0, 4])),
                       ir.Constant(v4, [0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    # bits 6-7 of a's (b's) bytes moved to bits 4-5: (w >> 2) & 0x30 in each byte is top2's (w >> 6 & 3) << 4
    top = builder.and_(builder.lshr(_pick(builder, v, [0, 0, 1, 1]), ir.Constant(v4, [2] * 4)),
                       ir.Constant(v4, [0, 0x30303030, 0, 0x30303030]))
    return builder.bitcast(builder.or_(low, top), ir.VectorType(_I8, 16))


def unpack_k4_levels(builder, a, b, c):
    """The 16 6-bit levels (sc_0..7, m_0..7) of a Q4_K/Q5_K super-block as <16 x i8>, from its 12
    `scales` bytes read as three little-endian i32 words: ggml's get_scale_min_k4, all at once with
    its mask trick (quant_matmul's float kernels unpack with it too)."""
    low6, low4, low2 = (ir.Constant(_I32, m) for m in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))

    def top2(v):  # bits 6-7 of each byte, moved to bits 4-5
        return builder.shl(builder.and_(builder.lshr(v, ir.Constant(_I32, 6)), low2), ir.Constant(_I32, 4))

    words = (builder.and_(a, low6),                                            # sc 0..3
             builder.or_(builder.and_(c, low4), top2(a)),                      # sc 4..7
             builder.and_(b, low6),                                            # m 0..3
             builder.or_(builder.and_(builder.lshr(c, ir.Constant(_I32, 4)), low4), top2(b)))  # m 4..7
    vec = ir.Constant(ir.VectorType(_I32, 4), None)
    for k, word in enumerate(words):
        vec = builder.insert_element(vec, word, ir.Constant(_I32, k))
    return builder.bitcast(vec, ir.VectorType(_I8, 16))


# --------------------------------------------------------------------------------------------------
# the weight side of one unit of each type: its chunks (block offset, 32 quants, 16-lane scale) and,
# for Q4_K/Q5_K, the 8 mins (dmin * m_j) that meet the activation's block sums
# --------------------------------------------------------------------------------------------------
class _Unit:
    """The weight side of a unit of 32-value blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): its chunks
    as (activation block offset, <32 x i8> quants, kind, unused), its float scales, one per block, as
    <4 x float> (0 beyond the unit's blocks) and, for Q4_1/Q5_1, its blocks' -m as <4 x float>, which
    meet the activation's block sums. Its activations are q8_0's (quad_offsets for 128)."""

    act_offset = Q8_0_OFFSET
    int_mins = None

    def __init__(self, chunks, scales, mins=None):
        self.chunks, self.scales, self.mins = chunks, scales, mins


class _KUnit:
    """The weight side of a K-quant super-block: its chunks as (activation block offset, <32 x i8>
    quants, kind, <8 x i32> integer sub-block scales of its lanes), the super-block's float scale d,
    and for Q4_K/Q5_K the 8 mins (dmin * m_j) that meet the activation's 32-value sums. The chunks'
    products times their integer scales add up exactly in int32 (the activation has one scale per
    256 values, convert.quantize_q8_k_split), and become float once per super-block. scales16: per
    chunk, its scale as <16 x i16> (unsigned chunks, on the x86 paths where _scaled_dots applies it).
    int_mins (Q2_K, whose mins are per 16 values): (per chunk, its lanes' integer mins as <8 x i32>;
    dmin), which meet the activation's 4-value sums in int32. offset16 (Q6_K, Q3_K): its sixteen scales as
    <16 x i16>, which meet the activation's 16-value sums to take the chunks' stored offset off once
    per super-block (_sixteen_offsets; the chunks are then dotted as unsigned). pairs (Q4_K, Q6_K
    where _WIDE): the chunks again as neighbouring pairs for one-token tiles (_paired_dots). Its
    activations are q8_K's (quad_offsets for 32)."""

    act_offset = Q6_K_OFFSET

    def __init__(self, chunks, d, mins=None, scales16=None, int_mins=None, offset16=None, pairs=None):
        self.chunks, self.d, self.mins, self.scales16, self.int_mins = chunks, d, mins, scales16, int_mins
        self.offset16, self.pairs = offset16, pairs


def _gather_f16(builder, blocks, at):
    """<4 x float>: the f16 at byte `at` of each block pointer (0 beyond them), gathered first and
    widened together (one vcvtph2ps per unit)."""
    bits = ir.Constant(ir.VectorType(_I16, _Q8_0_LANES), [0] * _Q8_0_LANES)
    for k, blk in enumerate(blocks):
        bits = builder.insert_element(bits, builder.load(builder.bitcast(_at(builder, blk, at), _I16.as_pointer()),
                                                         align=1), ir.Constant(_I32, k))
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), _Q8_0_LANES)),
                         ir.VectorType(_F32, _Q8_0_LANES))


def _blocks(size, quants, has_min=False):
    """A weight side of `count` blocks of a 32-value type (size bytes each, d f16 first, then m f16
    where has_min) from block `first` of the row; quants(builder, block) -> (<32 x i8>, kind)."""

    def of(count):
        def weight_side(builder, row, first):
            blocks = [_at(builder, row, builder.mul(builder.add(first, ir.Constant(_I64, k)), ir.Constant(_I64, size)))
                      for k in range(count)]
            chunks = [(k, *quants(builder, blk), None) for k, blk in enumerate(blocks)]
            mins = None
            if has_min:  # x = d*q + m: the m's are subtracted as mins are, so negated here (exactly)
                mins = builder.fmul(_gather_f16(builder, blocks, 2), ir.Constant(ir.VectorType(_F32, _Q8_0_LANES),
                                                                                 [-1.0] * _Q8_0_LANES))
            return _Unit(chunks, _gather_f16(builder, blocks, 0), mins)

        return weight_side

    return of


def _nibbles(builder, ptr):
    """<32 x i8> of the 16 bytes at ptr: low nibbles (values 0-15), then high nibbles (16-31)."""
    v16 = ir.VectorType(_I8, 16)
    packed = builder.load(builder.bitcast(ptr, v16.as_pointer()), align=1)
    low = builder.and_(packed, ir.Constant(v16, [15] * 16))
    high = builder.lshr(packed, ir.Constant(v16, [4] * 16))
    return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


def _fifth_bits(builder, ptr):
    """<32 x i8>: 16 where bit l of the little-endian u32 at ptr is set, else 0 (Q5_0/Q5_1's qh), as
    llama.cpp's bytes_from_bits_32: each lane takes its byte, then tests its bit."""
    word = builder.load(builder.bitcast(ptr, ir.VectorType(_I8, 4).as_pointer()), align=1)
    spread = builder.shuffle_vector(word, word, ir.Constant(ir.VectorType(_I32, 32), [l // 8 for l in range(32)]))
    bits = builder.and_(spread, ir.Constant(_V32I8, [1 << (l % 8) for l in range(32)]))
    return builder.select(builder.icmp_unsigned("!=", bits, _splat_i8(0)), _splat_i8(16), _splat_i8(0))


_IQ4_TABLE = [v & 0xFF for v in IQ4_LEVELS]


def _iq4_levels(builder, codes):
    """<32 x i8> of 4-bit codes -> the signed IQ4 levels they index (vpshufb on x86, as llama.cpp)."""
    if _AVX2:
        table = ir.Constant(_V32I8, _IQ4_TABLE * 2)  # vpshufb looks up within each 16-byte half
        return _call(builder, "llvm.x86.avx2.pshuf.b", _V32I8, table, codes)
    out = _splat_i8(0)
    for code, level in enumerate(_IQ4_TABLE):
        out = builder.select(builder.icmp_unsigned("==", codes, _splat_i8(code)), _splat_i8(level), out)
    return out


def _q8_0_quants(builder, blk):
    return _load_i8x32(builder, _at(builder, blk, 2)), SIGNED


def _q4_0_quants(builder, blk):
    return _nibbles(builder, _at(builder, blk, 2)), 8


def _q4_1_quants(builder, blk):
    return _nibbles(builder, _at(builder, blk, 4)), UNSIGNED


def _q5_0_quants(builder, blk):
    return builder.or_(_nibbles(builder, _at(builder, blk, 6)), _fifth_bits(builder, _at(builder, blk, 2))), 16


def _q5_1_quants(builder, blk):
    return builder.or_(_nibbles(builder, _at(builder, blk, 8)), _fifth_bits(builder, _at(builder, blk, 4))), UNSIGNED


def _iq4_nl_quants(builder, blk):
    return _iq4_levels(builder, _nibbles(builder, _at(builder, blk, 2))), SIGNED


def _k4(size, nibbles_at, fifth_bit):
    """A Q4_K (fifth_bit False) or Q5_K super-block: d, dmin f16 | scales[12] | (qh[32]) | qs[128];
    qs byte 32g + l holds value 64g + l (low nibble) and 64g + 32 + l (high nibble); in Q5_K bit j
    of qh[l] is bit 4 of value 32j + l."""

    def weight_side(builder, row, first):
        sb = _at(builder, row, builder.mul(builder.udiv(first, ir.Constant(_I64, 8)), ir.Constant(_I64, size)))
        levels = _k4_levels(builder, _at(builder, sb, 4))
        sc = builder.zext(levels, ir.VectorType(_I32, 16))
        dmin = _splat(builder, _load_f16(builder, _at(builder, sb, 2)), 8)
        mins = builder.fmul(_pick(builder, builder.uitofp(levels, ir.VectorType(_F32, 16)), range(8, 16)), dmin)
        qh = _load_i8x32(builder, _at(builder, sb, 16)) if fifth_bit else None
        sc16 = builder.zext(levels, ir.VectorType(_I16, 16))
        chunks, scales16 = [], []
        for g in range(4):
            packed = _load_i8x32(builder, _at(builder, sb, nibbles_at + 32 * g))
            for half in range(2):  # low nibbles: sub-block 2g, high nibbles: 2g + 1
                j = 2 * g + half
                q = builder.and_(packed, _splat_i8(15)) if half == 0 else builder.lshr(packed, _splat_i8(4))
                if fifth_bit:
                    bit = builder.and_(builder.lshr(qh, _splat_i8(j)), _splat_i8(1))
                    q = builder.or_(q, builder.shl(bit, _splat_i8(4)))
                chunks.append((j, q, UNSIGNED, _pick(builder, sc, [j] * 8)))
                scales16.append(_pick(builder, sc16, [j] * 16))
        pairs = _k4_pairs(builder, sb, sc16, nibbles_at) if _WIDE and not fifth_bit else None
        return _KUnit(chunks, _load_f16(builder, sb), mins, scales16 if _VNNI or _AVX2 else None, pairs=pairs)

    return weight_side


def _load_i8x64(builder, ptr):
    return builder.load(builder.bitcast(ptr, ir.VectorType(_I8, 64).as_pointer()), align=1)


def _k4_pairs(builder, sb, sc16, nibbles_at):
    """A Q4_K super-block's chunks in neighbouring pairs for 512-bit dots: (first chunk, <64 x i8>
    quants of chunks c and c + 1, <32 x i16> their scales). Two 64-byte loads hold all 8 chunks: a
    load's low nibbles are chunks 4p and 4p + 2, its high ones 4p + 1 and 4p + 3, regrouped by halves."""
    pairs = []
    for p in range(2):
        packed = _load_i8x64(builder, _at(builder, sb, nibbles_at + 64 * p))
        low, high = builder.and_(packed, _splat_i8(15, 64)), builder.lshr(packed, _splat_i8(4, 64))
        for c, halves in ((4 * p, list(range(32)) + list(range(64, 96))),
                          (4 * p + 2, list(range(32, 64)) + list(range(96, 128)))):
            q = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 64), halves))
            pairs.append((c, q, _pick(builder, sc16, [c] * 16 + [c + 1] * 16)))
    return pairs


def _q6_k_pairs(builder, sb, sc16):
    """A Q6_K super-block's chunks in neighbouring pairs (as _k4_pairs): in half h, chunks 4h + k and
    4h + k + 1 (k even) are the low (k = 0) or high nibbles of ql[64h..64h + 63] with bits 4-5 from
    qh[32h + l] >> 2k and >> 2k + 2, taken from qh and qh >> 2 side by side."""
    pairs = []
    for h in range(2):
        ql = _load_i8x64(builder, _at(builder, sb, 64 * h))
        qh = _load_i8x32(builder, _at(builder, sb, 128 + 32 * h))
        high = builder.shuffle_vector(qh, builder.lshr(qh, _splat_i8(2)), ir.Constant(ir.VectorType(_I32, 64),
                                                                                        list(range(64))))
        for k in (0, 2):
            low = builder.and_(ql, _splat_i8(15, 64)) if k == 0 else builder.lshr(ql, _splat_i8(4, 64))
            top = builder.and_(builder.lshr(high, _splat_i8(2 * k, 64)) if k else high, _splat_i8(3, 64))
            q = builder.or_(low, builder.shl(top, _splat_i8(4, 64)))
            s = 8 * h + 2 * k
            pairs.append((4 * h + k, q, _pick(builder, sc16, [s] * 8 + [s + 1] * 8 + [s + 2] * 8 + [s + 3] * 8)))
    return pairs


def _paired_dots(builder, unit, xq_row, first):
    """The int32 total of _scaled_dots from a unit's chunk pairs (512-bit vpmaddubsw, vpdpwssd by the
    pairs' 16-bit scales), the two chunks' lanes added at the end: the same integers."""
    v16i32 = ir.VectorType(_I32, 16)
    total = ir.Constant(v16i32, [0] * 16)
    for k, wq, s32 in unit.pairs:
        at = builder.mul(builder.add(first, ir.Constant(_I64, k)), ir.Constant(_I64, QK))
        x = _load_i8x64(builder, builder.gep(xq_row, [at], inbounds=True))
        prods = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(_I16, 32), wq, x)
        total = _call(builder, "llvm.x86.avx512.vpdpwssd.512", v16i32, total, builder.bitcast(prods, v16i32),
                      builder.bitcast(s32, v16i32))
    return builder.add(_pick(builder, total, range(8)), _pick(builder, total, range(8, 16)))


def _q6_k(builder, row, first):
    """A Q6_K super-block: ql[128] | qh[64] | int8 scales[16] | f16 d (210 bytes); in half h, value
    128h + 32k + l has low bits from ql[64h + l + 32(k&1)] (nibble k>>1), high bits qh[32h + l] >> 2k,
    scale scales[8h + l//16 + 2k] and is q - 32."""
    sb = _at(builder, row, builder.mul(builder.udiv(first, ir.Constant(_I64, 8)), ir.Constant(_I64, 210)))
    raw = builder.load(builder.bitcast(_at(builder, sb, 192), ir.VectorType(_I8, 16).as_pointer()), align=1)
    sc = builder.sext(raw, ir.VectorType(_I32, 16))
    sc16 = builder.sext(raw, ir.VectorType(_I16, 16))
    chunks, scales16 = [], []
    for h in range(2):
        lows = (_load_i8x32(builder, _at(builder, sb, 64 * h)), _load_i8x32(builder, _at(builder, sb, 64 * h + 32)))
        high = _load_i8x32(builder, _at(builder, sb, 128 + 32 * h))
        for k in range(4):
            low = lows[k & 1]
            low = builder.and_(low, _splat_i8(15)) if k < 2 else builder.lshr(low, _splat_i8(4))
            top = builder.and_(builder.lshr(high, _splat_i8(2 * k)), _splat_i8(3))
            q = builder.or_(low, builder.shl(top, _splat_i8(4)))
            # 8 lanes = 32 values in fours: lanes 0-3 are values 0-15 (scale 2k), 4-7 values 16-31
            chunks.append((4 * h + k, q, Q6_K_OFFSET, _pick(builder, sc, [8 * h + 2 * k] * 4 + [8 * h + 2 * k + 1] * 4)))
            scales16.append(_pick(builder, sc16, [8 * h + 2 * k] * 8 + [8 * h + 2 * k + 1] * 8))  # pmaddubsw's pairs
    return _KUnit(chunks, _load_f16(builder, _at(builder, sb, 208)), scales16=scales16 if _VNNI or _AVX2 else None,
                  offset16=sc16, pairs=_q6_k_pairs(builder, sb, sc16) if _WIDE else None)


def _super_block(builder, row, first, size):
    """Pointer to the super-block (size bytes) holding activation block `first` of the row."""
    return _at(builder, row, builder.mul(builder.udiv(first, ir.Constant(_I64, 8)), ir.Constant(_I64, size)))


def _crumbs(builder, sb, at, chunk):
    """Chunk `chunk`'s 2-bit fields of a Q2_K/Q3_K super-block whose qs start at byte `at`: chunk 4h + j
    is (qs[32h + l] >> 2j) & 3 for l < 32."""
    packed = _load_i8x32(builder, _at(builder, sb, at + 32 * (chunk // 4)))
    return builder.and_(builder.lshr(packed, _splat_i8(2 * (chunk % 4))), _splat_i8(3))


def _halves(builder, v, chunk):
    """A chunk's 8 lanes from a <16 x iN> of per-16-value fields: lanes 0-3 field 2c, 4-7 field 2c + 1."""
    return _pick(builder, v, [2 * chunk] * 4 + [2 * chunk + 1] * 4)


def _q2_k(builder, row, first):
    """A Q2_K super-block: scales[16] (low nibble the 16-value group's scale, high its min) | qs[64] |
    f16 d | f16 dmin (84 bytes); x = d * sc * q - dmin * m."""
    sb = _super_block(builder, row, first, 84)
    v16 = ir.VectorType(_I8, 16)
    raw = builder.load(builder.bitcast(sb, v16.as_pointer()), align=1)
    sc8 = builder.and_(raw, ir.Constant(v16, [15] * 16))
    sc, m = (builder.zext(v, ir.VectorType(_I32, 16)) for v in (sc8, builder.lshr(raw, ir.Constant(v16, [4] * 16))))
    sc16 = builder.zext(sc8, ir.VectorType(_I16, 16))
    chunks = [(c, _crumbs(builder, sb, 16, c), UNSIGNED, _halves(builder, sc, c)) for c in range(8)]
    # pmaddubsw's 16 pair sums: lanes 0-7 are values 0-15 (scale 2c), 8-15 values 16-31
    scales16 = [_pick(builder, sc16, [2 * c] * 8 + [2 * c + 1] * 8) for c in range(8)]
    int_mins = ([_halves(builder, m, c) for c in range(8)], _load_f16(builder, _at(builder, sb, 82)))
    return _KUnit(chunks, _load_f16(builder, _at(builder, sb, 80)), scales16=scales16 if _VNNI or _AVX2 else None,
                  int_mins=int_mins)


def _q3_k_scales(builder, sb):
    """Q3_K's sixteen 6-bit scales minus 32, as <16 x i32>, from its 12 bytes at sb + 96 read as three
    words (ggml's kmask unpacking, all at once)."""
    a, b, c = (builder.load(builder.bitcast(_at(builder, sb, 96 + 4 * k), _I32.as_pointer()), align=1) for k in range(3))
    low4, low2 = ir.Constant(_I32, 0x0F0F0F0F), ir.Constant(_I32, 0x03030303)

    def top(shift):  # 2 high bits of each byte's scale, from c, moved to bits 4-5
        return builder.shl(builder.and_(builder.lshr(c, ir.Constant(_I32, shift)), low2), ir.Constant(_I32, 4))

    def low(v, shift):
        return builder.and_(builder.lshr(v, ir.Constant(_I32, shift)), low4)

    words = (builder.or_(low(a, 0), top(0)), builder.or_(low(b, 0), top(2)), builder.or_(low(a, 4), top(4)),
             builder.or_(low(b, 4), top(6)))
    vec = ir.Constant(ir.VectorType(_I32, 4), None)
    for k, word in enumerate(words):
        vec = builder.insert_element(vec, word, ir.Constant(_I32, k))
    levels = builder.zext(builder.bitcast(vec, ir.VectorType(_I8, 16)), ir.VectorType(_I32, 16))
    return builder.sub(levels, ir.Constant(ir.VectorType(_I32, 16), [32] * 16))


def _q3_k(builder, row, first):
    """A Q3_K super-block: hmask[32] | qs[64] | scales[12] | f16 d (110 bytes); chunk c's values are
    q2_K's 2 bits plus bit c of hmask[l] as bit 2, u in 0..7 standing for u - 4."""
    sb = _super_block(builder, row, first, 110)
    hmask = _load_i8x32(builder, sb)
    sc = _q3_k_scales(builder, sb)
    sc16 = builder.trunc(sc, ir.VectorType(_I16, 16))  # -32..31
    chunks = []
    for c in range(8):
        top = builder.shl(builder.and_(builder.lshr(hmask, _splat_i8(c)), _splat_i8(1)), _splat_i8(2))
        chunks.append((c, builder.or_(_crumbs(builder, sb, 32, c), top), Q3_K_OFFSET, _halves(builder, sc, c)))
    # as Q6_K's: the chunks' unsigned u in pair sums times 16-bit scales, the offset off per super-block
    scales16 = [_pick(builder, sc16, [2 * c] * 8 + [2 * c + 1] * 8) for c in range(8)]
    return _KUnit(chunks, _load_f16(builder, _at(builder, sb, 108)), scales16=scales16 if _VNNI or _AVX2 else None,
                  offset16=sc16)


def _iq4_xs(builder, row, first):
    """An IQ4_XS super-block: f16 d | scales_h u16 | scales_l[4] | qs[128] (136 bytes): eight
    IQ4_NL-like sub-blocks, sub-block j's scale (nibble j of scales_l | 2 bits of scales_h) - 32."""
    sb = _super_block(builder, row, first, 136)
    high = builder.zext(builder.load(builder.bitcast(_at(builder, sb, 2), _I16.as_pointer()), align=1), _I32)
    low = builder.load(builder.bitcast(_at(builder, sb, 4), _I32.as_pointer()), align=1)
    chunks = []
    for j in range(8):
        nibble = builder.and_(builder.lshr(low, ir.Constant(_I32, 4 * j)), ir.Constant(_I32, 15))
        top = builder.shl(builder.and_(builder.lshr(high, ir.Constant(_I32, 2 * j)), ir.Constant(_I32, 3)),
                          ir.Constant(_I32, 4))
        scale = builder.sub(builder.or_(nibble, top), ir.Constant(_I32, 32))
        splat = builder.insert_element(ir.Constant(ir.VectorType(_I32, 8), None), scale, ir.Constant(_I32, 0))
        q = _iq4_levels(builder, _nibbles(builder, _at(builder, sb, 8 + 16 * j)))
        chunks.append((j, q, SIGNED, _pick(builder, splat, [0] * 8)))
    return _KUnit(chunks, _load_f16(builder, sb))


# --------------------------------------------------------------------------------------------------
# tiles: one weight row x T tokens
# --------------------------------------------------------------------------------------------------
class _Tokens:
    """Row pointers of tokens t0..t0+T-1 in the quantized activations xq [n, cols], xd, xs [n, blocks]
    and xc [n, cols / 4] (quad_offsets)."""

    def __init__(self, context, builder, sig, args, count):
        arrays = [context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args[2:6], args[2:6])]
        t0 = _i64(builder, args[6])
        self.q, self.d, self.s, self.c = [[self._row(builder, a, builder.add(t0, ir.Constant(_I64, j)), ty)
                                           for j in range(count)] for a, ty in zip(arrays, (_I8, _F32, _F32, _I32))]
        self.blocks = builder.udiv(builder.extract_value(arrays[0].shape, 1), ir.Constant(_I64, QK))  # 32-value blocks

    def sums16(self, builder, xc, first):
        """<16 x i16>: the 16-value sums of the super-block holding block `first` (a multiple of 8),
        from a token's xc row (quad_offsets puts them after the row's cols / 4 quads)."""
        at = builder.add(builder.mul(self.blocks, ir.Constant(_I64, 8)), first)
        ptr = builder.gep(xc, [at], inbounds=True)
        return builder.load(builder.bitcast(ptr, ir.VectorType(_I16, 16).as_pointer()), align=4)

    @staticmethod
    def _row(builder, array, t, elem):
        base = builder.bitcast(array.data, _I8.as_pointer())
        return builder.bitcast(_at(builder, base, builder.mul(t, builder.extract_value(array.strides, 0))),
                               elem.as_pointer())


def _emit_unit(builder, weight_side, row, tokens, accs, mins, first):
    """acc[t] += the unit starting at activation block `first`, for every token of the tile, and
    mins[t] += what its mins take off.

    Every token sees the same operations in the same order whatever the tile's size (strict IEEE
    adds and multiplies: no reassociation, no contraction), so a token's result does not depend on
    how many other tokens share its step."""
    unit = weight_side(builder, row, first)
    for t, (xq_row, xd, xs, xc) in enumerate(zip(tokens.q, tokens.d, tokens.s, tokens.c)):
        blocks = [builder.add(first, ir.Constant(_I64, k)) for k, *_ in unit.chunks]
        xqs = [_load_i8x32(builder, builder.gep(xq_row, [builder.mul(b, ir.Constant(_I64, QK))], inbounds=True))
               for b in blocks]
        if isinstance(unit, _KUnit) and (unit.offset16 is not None or unit.scales16 is not None):
            total = _k_total(builder, unit, xqs, xq_row, first, len(tokens.q) == 1)
            if unit.offset16 is not None:  # Q6_K, Q3_K: the offset off per super-block
                total = builder.sub(total, _sixteen_offsets(builder, unit.offset16, tokens.sums16(builder, xc, first),
                                                            unit.chunks[0][2]))
            value = _k_value(builder, unit, total, xd, first)
        else:
            dots = [_chunk_dot(builder, wq, kind, x, _offsets(builder, xc, b, kind, unit.act_offset))
                    for x, b, (k, wq, kind, _) in zip(xqs, blocks, unit.chunks)]
            if isinstance(unit, _KUnit):
                value = _k_unit_value(builder, unit, dots, xd, first)
            else:  # 32-value blocks: each block's exact integer dot times (weight scale x activation scale)
                scales = builder.fmul(unit.scales, _block_floats(builder, xd, first, len(unit.chunks)))
                value = builder.fmul(builder.sitofp(_block_sums(builder, dots), scales.type), scales)
        builder.store(builder.fadd(builder.load(accs[t]), value), accs[t])
        taken = _mins_value(builder, unit, xd, xs, xc, blocks, first)
        if taken is not None:
            builder.store(builder.fadd(builder.load(mins[t]), taken), mins[t])


def _k_total(builder, unit, xqs, xq_row, first, one_token):
    """<8 x i32>: a K-quant super-block's chunks dotted with a token's quants (xqs, from its row
    xq_row) times their integer scales, summed: by chunk pairs in a one-token tile where the unit
    has them, by _scaled_dots where it has 16-bit scales, else by quad sums (the same integers)."""
    if one_token and unit.pairs is not None:
        return _paired_dots(builder, unit, xq_row, first)
    if unit.scales16 is not None:
        return _scaled_dots(builder, unit, xqs)
    return _k_unit_total(builder, unit, [_u8_s8_quads(builder, wq, x) for x, (_, wq, _, _) in zip(xqs, unit.chunks)])


def _mins_value(builder, unit, xd, xs, xc, blocks, first):
    """What a unit's mins take off a token's result (None where it has none): float mins times the
    activation's 32-value sums (Q4_K, Q5_K; Q4_1, Q5_1 with their -m), or Q2_K's integer mins times
    its 4-value sums, exact in int32 and made float once per super-block."""
    if unit.mins is not None:
        count = unit.mins.type.count
        sums = _load_f32x8(builder, builder.gep(xs, [first], inbounds=True)) if count == 8 else \
            _block_floats(builder, xs, first, len(unit.chunks))
        return builder.fmul(unit.mins, sums)
    if unit.int_mins is None:
        return None
    lanes, dmin = unit.int_mins
    total = None
    for m, b in zip(lanes, blocks):  # xc holds -32 x each 4-value sum: the total is -32 x sum(m * sums)
        part = builder.mul(m, _offsets(builder, xc, b, unit.act_offset, unit.act_offset))
        total = part if total is None else builder.add(total, part)
    exact = builder.neg(builder.ashr(total, ir.Constant(ir.VectorType(_I32, 8), [5] * 8)))
    x_scale = builder.load(builder.gep(xd, [builder.udiv(first, ir.Constant(_I64, 8))], inbounds=True))
    return builder.fmul(builder.sitofp(exact, _V8F), _splat(builder, builder.fmul(dmin, x_scale), 8))


def _offsets(builder, xc, block, kind, act_offset):
    """<8 x i32>: -k x the 4-value sums of 32-value block `block`, for the offset k a chunk of `kind`
    needs (128 for SIGNED with VNNI), from quad_offsets xc made for act_offset (128 for q8_0, 32 for
    q8_K activations): both are powers of two, so the rescaling is an exact shift."""
    needed = 128 if kind == SIGNED and _VNNI else kind if kind > 0 else None
    if needed is None:
        return None
    ptr = builder.gep(xc, [builder.mul(block, ir.Constant(_I64, 8))], inbounds=True)
    v = builder.load(builder.bitcast(ptr, ir.VectorType(_I32, 8).as_pointer()), align=4)
    if needed == act_offset:
        return v
    shift = ir.Constant(ir.VectorType(_I32, 8), [abs(needed.bit_length() - act_offset.bit_length())] * 8)
    return builder.shl(v, shift) if needed > act_offset else builder.ashr(v, shift)


def _k_unit_value(builder, unit, dots, xd, first):
    """<8 x float> of a K-quant super-block against its 256-value activation block: the chunks'
    integer products times their integer scales summed in int32, then times d * the activation's
    scale (xd holds one per super-block)."""
    return _k_value(builder, unit, _k_unit_total(builder, unit, dots), xd, first)


def _k_unit_total(builder, unit, dots):
    """<8 x i32>: the chunks' integer products times their integer scales, summed."""
    total = None
    for (k, wq, kind, iscale), dot in zip(unit.chunks, dots):
        part = builder.mul(dot, iscale)
        total = part if total is None else builder.add(total, part)
    return total


def _sixteen_offsets(builder, scales, sums, offset):
    """<8 x i32>: offset x (scale 2i x sum 2i + scale 2i+1 x sum 2i+1) in lane i, from a Q6_K or Q3_K
    super-block's sixteen scales and its activation's sixteen 16-value sums (<16 x i16> each): what
    its stored offset (32, 4: a power of two) adds to the chunks' unsigned dots (vpmaddwd on x86;
    the same integers elsewhere). Exact: |scale| <= 128, |sum| <= 2032."""
    v8i32 = ir.VectorType(_I32, 8)
    if _AVX2:
        pairs = _call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, scales, sums)
    else:
        wide = ir.VectorType(_I32, 16)
        pairs = _pair_sums(builder, builder.mul(builder.sext(scales, wide), builder.sext(sums, wide)), 16)
    return builder.shl(pairs, ir.Constant(v8i32, [offset.bit_length() - 1] * 8))


def _scaled_dots(builder, unit, xqs):
    """The int32 total of _k_unit_value for unsigned chunks, as llama.cpp forms it: each chunk's
    pair sums (vpmaddubsw: <= 2 x 31 x 127, no saturation) times its 16-bit scale, pairs summed
    and accumulated (vpdpwssd with VNNI, vpmaddwd + vpaddd without): two instructions a chunk
    where the quad sums took three (vpdpbusd, vpmulld, vpaddd), and the same integers."""
    v8i32, v16i16 = ir.VectorType(_I32, 8), ir.VectorType(_I16, 16)
    total = ir.Constant(v8i32, [0] * 8)
    for (k, wq, kind, _), x, s16 in zip(unit.chunks, xqs, unit.scales16):
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, wq, x)
        if _VNNI:
            total = _call(builder, "llvm.x86.avx512.vpdpwssd.256", v8i32, total, builder.bitcast(pairs, v8i32),
                          builder.bitcast(s16, v8i32))
        else:
            total = builder.add(total, _call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, pairs, s16))
    return total


def _k_value(builder, unit, total, xd, first):
    """<8 x float>: a super-block's int32 total times d * the activation's scale."""
    x_scale = builder.load(builder.gep(xd, [builder.udiv(first, ir.Constant(_I64, 8))], inbounds=True))
    return builder.fmul(builder.sitofp(total, _V8F), _splat(builder, builder.fmul(unit.d, x_scale), 8))


def _block_floats(builder, xd, first, count):
    """<4 x float>: xd[first .. first + count - 1] (0 beyond), a unit of 32-value blocks' activation
    scales (xd) or block sums (xs)."""
    ptr = builder.gep(xd, [first], inbounds=True)
    if count == _Q8_0_LANES:
        return builder.load(builder.bitcast(ptr, ir.VectorType(_F32, count).as_pointer()), align=4)
    vector = ir.Constant(ir.VectorType(_F32, _Q8_0_LANES), [0.0] * _Q8_0_LANES)
    for k in range(count):
        vector = builder.insert_element(vector, builder.load(builder.gep(ptr, [ir.Constant(_I64, k)], inbounds=True)),
                                        ir.Constant(_I32, k))
    return vector


def _block_sums(builder, dots):
    """<4 x i32>: lane k the sum of dots[k]'s 8 lanes (a Q8_0 block's exact integer dot), 0 beyond
    len(dots) <= 4. Pairs of vectors are summed as vphaddd does (within 128-bit halves), twice, then
    the halves: 3 shuffle-add rounds for four blocks instead of a float broadcast per block."""
    zero = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)
    if len(dots) == 1:  # a tail block: its 8 lanes halved three times, into lane 0
        v = dots[0]
        for n in (8, 4, 2):
            v = builder.add(_pick(builder, v, range(n // 2)), _pick(builder, v, range(n // 2, n)))
        return builder.shuffle_vector(v, ir.Constant(v.type, [0]), ir.Constant(ir.VectorType(_I32, 4), [0, 1, 1, 1]))
    dots = list(dots) + [zero] * (4 - len(dots))

    def hadd(a, b):  # [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
        even = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), [0, 2, 8, 10, 4, 6, 12, 14]))
        odd = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), [1, 3, 9, 11, 5, 7, 13, 15]))
        return builder.add(even, odd)

    quads = hadd(hadd(dots[0], dots[1]), hadd(dots[2], dots[3]))  # [k's lanes 0-3 ... | k's lanes 4-7 ...]
    return builder.add(_pick(builder, quads, range(4)), _pick(builder, quads, range(4, 8)))


def _tile(name, weight_side, blocks_per_unit, T, tail=None, lanes=8, R=1):
    """An intrinsic (w, r, xq, xd, xs, xc, t0) -> UniTuple(float32, R * T): rows r..r+R-1 of w (uint8
    [rows, row_bytes]) dotted with tokens t0..t0+T-1 of the quantized activations (xc: their
    quad_offsets), row by row.

    A row is walked in units of blocks_per_unit activation blocks (4 Q8_0 blocks, or one K-quant
    super-block); `tail` (Q8_0) takes the 0-3 blocks after the last whole unit one at a time. Each
    (row, token) goes through the same operations whatever R and T, so its result does not depend
    on the tile that computed it."""
    ret = types.UniTuple(types.float32, R * T)

    def codegen(context, builder, sig, args):
        w = context.make_array(sig.args[0])(context, builder, args[0])
        base, stride = builder.bitcast(w.data, _I8.as_pointer()), builder.extract_value(w.strides, 0)
        r0 = _i64(builder, args[1])
        rows = [_at(builder, base, builder.mul(builder.add(r0, ir.Constant(_I64, i)), stride)) for i in range(R)]
        tokens = _Tokens(context, builder, sig, args, T)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(_F32, lanes), [0.0] * lanes))
                 for _ in range(T)] for _ in range(R)]
        mins = [[cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(_F32, lanes), [0.0] * lanes))
                 for _ in range(T)] for _ in range(R)]
        unit = ir.Constant(_I64, blocks_per_unit)
        whole = builder.udiv(tokens.blocks, unit)
        for i in range(R):  # row after row: interleaved, two rows halved a DRAM-bound matvec's speed
            with cgutils.for_range(builder, whole) as loop:
                _emit_unit(builder, weight_side, rows[i], tokens, accs[i], mins[i], builder.mul(loop.index, unit))
            if tail is not None:
                done = builder.mul(whole, unit)
                with cgutils.for_range(builder, builder.sub(tokens.blocks, done)) as loop:
                    _emit_unit(builder, tail, rows[i], tokens, accs[i], mins[i], builder.add(done, loop.index))
        out = context.get_constant_undef(ret)
        for i in range(R):
            for t in range(T):
                value = builder.fsub(_hsum(builder, builder.load(accs[i][t])), _hsum(builder, builder.load(mins[i][t])))
                out = builder.insert_value(out, value, i * T + t)
        return out

    def typer(typingctx, w, r, xq, xd, xs, xc, t0):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8 and w.layout == "C"
                and xq == types.Array(types.int8, 2, "C") and xd == xs == types.Array(types.float32, 2, "C")
                and xc == types.Array(types.int32, 2, "C") and isinstance(r, types.Integer)
                and isinstance(t0, types.Integer)):
            return None
        return ret(w, r, xq, xd, xs, xc, t0), codegen

    typer.__name__ = f"{name}_{R}x{T}"
    return intrinsic(typer)


def _tiles(name, weight_side, blocks_per_unit, tail=None, lanes=8):
    """One tile per size in TILE_SIZES, then the ROW_PAIR tile (lanes: of the float accumulators the
    units' values add into)."""
    return tuple(_tile(name, weight_side, blocks_per_unit, T, tail, lanes) for T in TILE_SIZES) + (
        _tile(name, weight_side, blocks_per_unit, 1, tail, lanes, R=2),)


# One weight row per tile: interleaving two rows' blocks halved the speed of a DRAM-bound matvec
# (19 -> 9 GB/s on one core), the hardware prefetcher following one stream per row best. A tile of
# 4 tokens reuses each weight chunk, once unpacked, four times (4 x 8-lane accumulators fit AVX2).
TILE_TOKENS = 4
# tokens per tile: whole tiles of TILE_TOKENS, then the 1-3 left in one tile of their number (a
# verification of 2 or 3 tokens ran them one at a time, each reading the row's blocks again)
TILE_SIZES = (TILE_TOKENS, 3, 2, 1)
# Tokens left after the whole tiles (the one token of a plain decode step) meet two rows per tile,
# row after row: a row's fixed cost in a one-row tile (pointers, loop set-up, horizontal sums, store,
# the type switch) was ~5 ns, 5 Q8_0 blocks' worth on one thread, 30% of a 384-column row.
ROW_PAIR = len(TILE_SIZES)  # index of the 2-row, 1-token tile in each type's tiles



def _small_tiles(name, size, quants, has_min=False):
    """The tiles of a 32-value type: units of 4 blocks, then a tail of single blocks."""
    of = _blocks(size, quants, has_min)
    return _tiles(name, of(_Q8_0_LANES), _Q8_0_LANES, tail=of(1), lanes=_Q8_0_LANES)


Q8_0_TILES = _small_tiles("q8_0", 34, _q8_0_quants)
Q4_0_TILES = _small_tiles("q4_0", 18, _q4_0_quants)
Q4_1_TILES = _small_tiles("q4_1", 20, _q4_1_quants, has_min=True)
Q5_0_TILES = _small_tiles("q5_0", 22, _q5_0_quants)
Q5_1_TILES = _small_tiles("q5_1", 24, _q5_1_quants, has_min=True)
IQ4_NL_TILES = _small_tiles("iq4_nl", 18, _iq4_nl_quants)
Q2_K_TILES = _tiles("q2_k", _q2_k, 8)
Q3_K_TILES = _tiles("q3_k", _q3_k, 8)
IQ4_XS_TILES = _tiles("iq4_xs", _iq4_xs, 8)
Q4_K_TILES = _tiles("q4_k", _k4(144, 16, False), 8)
Q5_K_TILES = _tiles("q5_k", _k4(176, 48, True), 8)
Q6_K_TILES = _tiles("q6_k", _q6_k, 8)
