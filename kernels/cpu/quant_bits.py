"""Bit-level reads of quantized blocks that numba lacks: IEEE half and bfloat16 bits to float32, a
quant's bit fields and the Q4_K/Q5_K header in 32-bit IR, array loads without numba's negative-index
wraparound, a float division without Python's zero check, and the small field readers the row
kernels share (quant_matmul.py's float rows, int8_prompt.py's integer rows).

numba widens small-int arithmetic to int64, which LLVM then vectorizes in 64-bit lanes (4x fewer per
instruction, plus conversions), so the fields are extracted by intrinsics written as 32-bit IR.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ember.kernels.cpu.int8_dots import unpack_k4_levels

# Dequantizing rows: no reassoc and no FMA contraction, so values equal quant_reference's bit for bit.
EXACT = dict(fastmath={"nnan", "ninf", "nsz", "arcp", "afn"}, cache=True, nogil=True)


def _as_i16(builder, v):
    if v.type.width > 16:
        return builder.trunc(v, ir.IntType(16))
    return builder.zext(v, ir.IntType(16)) if v.type.width < 16 else v


@intrinsic
def f16(typingctx, bits):
    """float32 of IEEE half bits (any integer type; the low 16 bits are used). Exact, inf/nan kept."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        half = builder.bitcast(_as_i16(builder, args[0]), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bf16(typingctx, bits):
    """float32 of bfloat16 bits: the bits are the top half of a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        wide = builder.zext(_as_i16(builder, args[0]), ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(bits), codegen


def _bit_fields(low_bits):
    """An intrinsic (lo, lo_shift, hi, hi_shift, hi_mask, bias) -> float32(((lo >> lo_shift) & low |
    ((hi >> hi_shift) & hi_mask) << low_bits) - bias), low = 2**low_bits - 1, in 32-bit ints.

    Written as LLVM IR because numba widens small-int arithmetic to int64, which LLVM then vectorizes
    in 64-bit lanes (4x fewer per instruction, plus conversions)."""

    def typer(typingctx, lo, lo_shift, hi, hi_shift, hi_mask, bias):
        if not all(isinstance(a, types.Integer) for a in (lo, lo_shift, hi, hi_shift, hi_mask, bias)):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)

            def as_i32(v):
                if v.type.width > 32:
                    return builder.trunc(v, i32)
                return builder.zext(v, i32) if v.type.width < 32 else v

            lo_v, lo_s, hi_v, hi_s, hi_m, b = (as_i32(a) for a in args)
            low = builder.and_(builder.lshr(lo_v, lo_s), ir.Constant(i32, (1 << low_bits) - 1))
            high = builder.shl(builder.and_(builder.lshr(hi_v, hi_s), hi_m), ir.Constant(i32, low_bits))
            return builder.sitofp(builder.sub(builder.or_(low, high), b), ir.FloatType())

        return types.float32(lo, lo_shift, hi, hi_shift, hi_mask, bias), codegen

    typer.__name__ = f"bit_fields_{low_bits}"
    return intrinsic(typer)


# One quant from a low-bits byte and a high-bits byte: a nibble and 0-2 high bits (Q4_0 ... Q6_K:
# hi_mask 0 for none), or 2 bits and a third one (Q2_K, Q3_K).
quant = _bit_fields(4)
quant3 = _bit_fields(2)


@intrinsic
def k4_header(typingctx, w0, w1, w2, d, dmin):
    """The 16 multipliers of a Q4_K/Q5_K super-block: (d*sc_0..7, dmin*m_0..7) as a 16-tuple.

    w0..w2 are its 12 `scales` bytes read as little-endian uint32 words. ggml packs eight 6-bit
    (sc, m) pairs there (get_scale_min_k4); int8_dots.unpack_k4_levels (ggml's AVX mask trick)
    unpacks all of them at once into 16 bytes, which LLVM then widens and scales as one vector.
    """
    if not all(isinstance(a, types.Integer) for a in (w0, w1, w2)) or not d == dmin == types.float32:
        return None
    ret = types.UniTuple(types.float32, 16)

    def codegen(context, builder, sig, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        a, b, c = (builder.trunc(v, i32) if v.type.width > 32 else builder.zext(v, i32)
                   if v.type.width < 32 else v for v in args[:3])
        v16 = ir.VectorType(f32, 16)
        levels = builder.uitofp(unpack_k4_levels(builder, a, b, c), v16)
        factors = ir.Constant(v16, None)
        for k in range(16):
            factors = builder.insert_element(factors, args[3] if k < 8 else args[4], ir.Constant(i32, k))
        scaled = builder.fmul(levels, factors)
        out = context.get_constant_undef(ret)
        for k in range(16):
            out = builder.insert_value(out, builder.extract_element(scaled, ir.Constant(i32, k)), k)
        return out

    return ret(w0, w1, w2, d, dmin), codegen


@intrinsic
def ld(typingctx, arr, i, j):
    """arr[i, j] of a 2-D array, without numba's negative-index wraparound.

    numba turns every a[k] into a[k + n if k < 0 else k]; where LLVM cannot prove k >= 0 (e.g. k =
    34*b + l) that select stays, and consecutive loads become gathers. Indices here are never negative.
    """
    if not (isinstance(arr, types.Array) and arr.ndim == 2):
        return None
    return arr.dtype(arr, i, j), _load_codegen


@intrinsic
def ld1(typingctx, arr, j):
    """arr[j] of a 1-D array, without negative-index wraparound (see ld)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None
    return arr.dtype(arr, j), _load_codegen


@intrinsic
def ieee_div(typingctx, a, b):
    """float32 a / b, IEEE's (b = 0 gives an infinity or NaN): numba's `/` checks b for zero to raise
    ZeroDivisionError, a branch per element that kept LLVM from vectorizing a loop around it."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fdiv(args[0], args[1])

    return types.float32(a, b), codegen


def _load_codegen(context, builder, sig, args):
    aty = sig.args[0]
    ary = context.make_array(aty)(context, builder, value=args[0])
    ptr = cgutils.get_item_pointer2(context, builder, ary.data, cgutils.unpack_tuple(builder, ary.shape),
                                    cgutils.unpack_tuple(builder, ary.strides), aty.layout, list(args[1:]),
                                    wraparound=False, boundscheck=False)
    return context.unpack_value(builder, aty.dtype, ptr)


@njit(inline="always", **EXACT)
def fifth_bits(u16, r, word):
    """A Q5_0/Q5_1 block's qh: the little-endian u32 at 16-bit word `word` of row r."""
    return np.uint32(u16[r, word]) | (np.uint32(u16[r, word + 1]) << np.uint32(16))


@njit(inline="always", **EXACT)
def q3_k_scale(u8, r, o, g):
    """Group g's signed 6-bit scale s - 32 from a Q3_K super-block's 12 scale bytes at o + 96."""
    low = (np.int32(u8[r, o + 96 + g]) & 15) if g < 8 else (np.int32(u8[r, o + 88 + g]) >> 4)
    high = (np.int32(u8[r, o + 104 + g % 4]) >> (2 * (g // 4))) & 3
    return np.float32((low | (high << 4)) - 32)
