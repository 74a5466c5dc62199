"""Prompt rows of quantized weights in integer arithmetic: the product behind `prompt_act = "q8_0"`.

This module owns the integer product of many tokens (a prompt chunk) with a quantized weight, the
way llama.cpp computes prompts: the activations are quantized exactly as the decode rows' are
(int8_dots.py: ggml's q8_0 against 32-value block types, q8_K's 256-value blocks against K-quants and
IQ4_XS), and meet the weight's quants in integer arithmetic. Every block type is read: each row is
unpacked once per call, by the decode tiles' own readers of its blocks, into signed int8 quants,
one float scale a and one float offset b per group of 16 or 32 values (the weight being a * q + b
there: d * sc * q - dmin * m for Q4_K, d * (q - 8) for Q4_0, ...), and the group's integer dot
becomes float once: y[t] += (a * dx[t]) * dot + b * (dx[t] * sum(q_x)). The same x_hat as a decode
row's, so the two differ only by float32 rounding (the order of the group terms).

Why it looks the way it does:
- Tokens lie across the vector lanes, not values: a 512-bit vector holds 4 consecutive activation
  quants of each of 16 tokens, and one vpdpbusd multiplies it by one broadcast quad of the weight row,
  16 tokens' exact partial dots in 16 int32 lanes. No horizontal sums and no per-token scale
  conversions inside a group: those, per block and per token, are what held the decode tiles
  (int8_dots.py) to 2.4x a token's cost for 4 tokens. A group's float work (convert, scale, add) is
  shared by its 16 tokens.
- vpdpbusd takes one unsigned and one signed operand. The activations are stored as q + 128
  (unsigned), the weights signed; each group's accumulator starts from -128 x the sum of its weight
  quants (computed at unpacking), so the sum comes out exact: sum((q_x + 128) * w) - 128 * sum(w).
- Register tiles of 4 rows x 2 token vectors (32 tokens): each loaded activation vector meets 4
  broadcast weight quads and each broadcast 2 activation vectors, 8 accumulators in flight (with AVX2,
  whose 16 registers hold half as much, one token vector at a time).
- Rows are unpacked 16 at a time into L1-sized buffers (each row once per call, whatever the number
  of tokens), as the float prompt product dequantizes them (quant_matmul._matmul).
- Every token lane goes through the same operations in the same order (strict IEEE, explicit fused
  multiply-adds), whatever the tile, the number of tokens or the padding: a token's result does not
  depend on the other tokens of its call, or on how a prompt was cut into chunks.
- Without AVX-512 VNNI: with AVX2, the activations are stored signed. Weights whose quants are small
  unsigned levels (Q4_K, Q6_K, Q4_0, ... as stored, offsets included) are vpmaddubsw's unsigned
  operand and its int16 pair sums add up over 2-8 quads before one vpmaddwd (the stored offset comes
  off through the activations' sums); signed ones (Q8_0, IQ4) take llama.cpp's signed pairs (vpsignb,
  vpmaddubsw, vpmaddwd). 512 tokens through Q4_K 2048 x 768 take 6.7 ms, f32 rows 10 ms (Zen 3,
  2 threads). Elsewhere the same IR written portably (widen, multiply, sum fours), 5x slower than
  the float product. The same integers on every path. EMBER_INT8_PATH (int8_dots.py) picks them for
  tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ember.kernels.cpu import int8_dots
from ember.kernels.cpu.int8_dots import _VNNI, _call
from ember.kernels.cpu.twin import Twin
from ember.kernels.tensor_types import TensorType

__all__ = ["INT8_PROMPT_TYPES", "PromptActivations", "quantize", "product", "matmul"]

LANES = 16  # tokens per vector: 16 int32 lanes of a 512-bit register
_CHUNK_ROWS = 16  # rows unpacked together: 16 x cols int8 stays in L1
_TILE_ROWS = 4
_TILE_VECTORS = 2  # token vectors per tile
_BLOCK = 32  # activation values per float scale

# per type: values per scale group (16 where the format scales 16 values), and whether w = a*q + b
# has an offset b (its mins) that meets the activations' sums
_GROUP = {TensorType.Q8_0: (32, False), TensorType.Q4_0: (32, False), TensorType.Q5_0: (32, False),
          TensorType.IQ4_NL: (32, False), TensorType.IQ4_XS: (32, False), TensorType.Q4_1: (32, True),
          TensorType.Q5_1: (32, True), TensorType.Q4_K: (32, True), TensorType.Q5_K: (32, True),
          TensorType.Q6_K: (16, False), TensorType.Q3_K: (16, False), TensorType.Q2_K: (16, True)}
INT8_PROMPT_TYPES = frozenset(_GROUP)
_K_ACTIVATIONS = np.zeros(max(TensorType) + 1, np.bool_)
_K_ACTIVATIONS[[TensorType.Q2_K, TensorType.Q3_K, TensorType.Q4_K, TensorType.Q5_K, TensorType.Q6_K,
                TensorType.IQ4_XS]] = True


@dataclass(frozen=True)
class PromptActivations:
    """n tokens' activations quantized for the product, 16 tokens per vector v: xu uint8 [v, cols * 16]
    (value c of lane l at (c // 4) * 64 + 4 * l + c % 4, stored as q + _X_OFFSET: q + 128, or q with AVX2), xd float32 [v, cols / 32
    * 16] (the scale of the 32 values of block b at 16 * b + l) and xsum int32 [v, cols / 16 * 16] (the
    sum of the quants of values 16k..16k+15 at 16 * k + l). Lanes past the n tokens are zeros (scale
    0). k_quants: quantized as q8_K (for K-quant and IQ4_XS weights), else as q8_0."""

    xu: np.ndarray
    xd: np.ndarray
    xsum: np.ndarray
    n: int
    k_quants: bool


def quantize(x: np.ndarray, k_quants: bool) -> PromptActivations:
    """x float32 [n, cols] (C-contiguous) quantized as the decode rows' activations are
    (int8_dots.quantize_activation, _k), bit for bit: ggml's q8_0 (32 values, an f16 scale) or, with
    k_quants, q8_K (256 values, a float32 scale); d = max|x| / 127, x * (1/d) rounded half away from
    zero, 0 where that is not finite. Once for every weight of its kind that multiplies the same x."""
    n, cols = x.shape
    vectors = -(-n // LANES)
    acts = PromptActivations(np.empty((vectors, cols * LANES), np.uint8),
                             np.empty((vectors, cols // _BLOCK * LANES), np.float32),
                             np.empty((vectors, cols // 16 * LANES), np.int32), n, k_quants)
    _QUANTIZE.pick(n * cols)(x, k_quants, acts.xu, acts.xd, acts.xsum)
    return acts


def k_quant_activations(code: int) -> bool:
    """Whether weights of type `code` meet q8_K activations (as in the decode tiles), not q8_0."""
    return bool(_K_ACTIVATIONS[code])


def product(code: int, u8: np.ndarray, acts: PromptActivations, rows: int) -> np.ndarray:
    """The quantized weight of type `code`, its rows' bytes u8 [rows, row_bytes] (C-contiguous), times
    the activations (quantized for its kind), transposed -> float32 [n, rows]."""
    if acts.k_quants != k_quant_activations(code):
        raise ValueError(f"{TensorType(code).name} weights meet {'q8_K' if not acts.k_quants else 'q8_0'} activations")
    out = np.empty((acts.n, rows), np.float32)
    _PRODUCT.pick(u8.size * acts.n)(code, u8, acts.xu, acts.xd, acts.xsum, _GROUP[TensorType(code)][0],
                                    _TILE_OF[code], out)
    return out


def matmul(code: int, u8: np.ndarray, x: np.ndarray, rows: int) -> np.ndarray:
    """product(code, u8, quantize(x, ...), rows): x float32 [n, cols] times the weight transposed."""
    return product(code, u8, quantize(x, k_quant_activations(code)), rows)


_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VI32, _VF32 = ir.VectorType(_I32, LANES), ir.VectorType(_F32, LANES)
_V32I8, _V8I32, _V16I16 = ir.VectorType(_I8, 32), ir.VectorType(_I32, 8), ir.VectorType(ir.IntType(16), 16)

# Without VNNI but with AVX2, llama.cpp's instructions: vpmaddubsw (unsigned x signed bytes, int16
# pair sums) and vpmaddwd (pairs summed to int32). The activations are stored signed (q, not q + 128)
# and the accumulators start from 0. Weights whose quants are unsigned small levels (Q4_K 0..15, Q6_K
# 0..63 standing for q - 32, ...: _UNSIGNED_QUANTS) are kept unsigned and are vpmaddubsw's unsigned
# operand, their int16 sums added over as many quads as stay exact before vpmaddwd widens them, the
# stored offset coming off through the activations' sums; signed ones (Q8_0, the IQ4 levels) take
# llama.cpp's signed pairs (|w| times x with w's sign). The same integers as vpdpbusd: the same
# results, bit for bit. (The portable IR, widen and multiply, ran 5x slower than the float product on
# the 2-core Zen 3 VM.)
_SIGNED_PAIRS = not _VNNI and int8_dots._AVX2
_X_OFFSET = 0 if _SIGNED_PAIRS else 128  # what the activations' stored bytes add to q
# per type whose quants are stored unsigned: (the stored offset, the largest stored level)
_UNSIGNED_QUANTS = {} if not _SIGNED_PAIRS else {
    TensorType.Q4_0: (8, 15), TensorType.Q4_1: (0, 15), TensorType.Q5_0: (16, 31), TensorType.Q5_1: (0, 31),
    TensorType.Q2_K: (0, 3), TensorType.Q3_K: (4, 7), TensorType.Q4_K: (0, 15), TensorType.Q5_K: (0, 31),
    TensorType.Q6_K: (32, 63)}


# --------------------------------------------------------------------------------------------------
# the activations: 16 tokens per vector, quads of values interleaved by token
# --------------------------------------------------------------------------------------------------
def _token_quantizer(block, f16_scale):
    """An intrinsic (x, t, xu, xd, xsum, v, lane) -> 0 quantizing token t of x (float32 [n, cols]) into
    lane `lane` of vector v of xu, xd, xsum, `block` values to a scale (32 or 256), rounded to f16 where
    f16_scale (after 1/d is taken, as ggml does): int8_dots._quantize_blocks' rules, as vectors
    (llvm.round rounds halves away from zero, as C's roundf)."""
    chunks = block // _BLOCK

    def codegen(context, builder, sig, args):
        xa, ua, da, sa = (context.make_array(ty)(context, builder, a) for ty, a in
                          zip((sig.args[0], *sig.args[2:5]), (args[0], *args[2:5])))
        t_, v_, lane_ = (builder.sext(a, _I64) if a.type.width < 64 else a for a in (args[1], args[5], args[6]))
        v32f, v32i = ir.VectorType(_F32, 32), ir.VectorType(_I32, 32)
        x_row = _row_ptr(builder, xa, t_, v32f)
        u_row = builder.gep(_row_ptr(builder, ua, v_, _I8), [builder.mul(lane_, ir.Constant(_I64, 4))], inbounds=True)
        d_row = builder.gep(_row_ptr(builder, da, v_, _F32), [lane_], inbounds=True)
        s_row = builder.gep(_row_ptr(builder, sa, v_, _I32), [lane_], inbounds=True)
        scales = builder.udiv(builder.extract_value(xa.shape, 1), ir.Constant(_I64, block))
        with cgutils.for_range(builder, scales) as loop:
            first = builder.mul(loop.index, ir.Constant(_I64, chunks))
            xs = [builder.load(builder.gep(x_row, [builder.add(first, ir.Constant(_I64, c))], inbounds=True), align=4)
                  for c in range(chunks)]
            absolute = [_call(builder, "llvm.fabs.v32f32", v32f, xv) for xv in xs]
            amax = absolute[0]
            for more in absolute[1:]:
                amax = builder.select(builder.fcmp_ordered(">", amax, more), amax, more)
            d = builder.fdiv(_max_tree(builder, amax), ir.Constant(_F32, 127.0))
            zero = builder.fcmp_ordered("==", d, ir.Constant(_F32, 0.0))
            inv = _splat(builder, builder.select(zero, ir.Constant(_F32, 0.0), builder.fdiv(ir.Constant(_F32, 1.0), d)),
                         v32f)
            stored = builder.fpext(builder.fptrunc(d, ir.HalfType()), _F32) if f16_scale else d
            for c, xv in enumerate(xs):
                b = builder.add(first, ir.Constant(_I64, c))  # the 32-value block
                value = builder.fmul(xv, inv)
                finite = builder.fcmp_ordered("<", _call(builder, "llvm.fabs.v32f32", v32f, value),
                                              ir.Constant(v32f, [float("inf")] * 32))
                q = builder.select(finite, builder.fptosi(_call(builder, "llvm.round.v32f32", v32f, value), v32i),
                                   ir.Constant(v32i, [0] * 32))
                builder.store(stored, builder.gep(d_row, [builder.mul(b, ir.Constant(_I64, LANES))], inbounds=True))
                for h in range(2):
                    lanes = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * h, 16 * h + 16)))
                    half = builder.shuffle_vector(q, q, lanes)
                    at = builder.mul(builder.add(builder.mul(b, ir.Constant(_I64, 2)), ir.Constant(_I64, h)),
                                     ir.Constant(_I64, LANES))
                    builder.store(_call(builder, "llvm.vector.reduce.add.v16i32", _I32, half),
                                  builder.gep(s_row, [at], inbounds=True))
                u = builder.bitcast(builder.trunc(builder.add(q, ir.Constant(v32i, [_X_OFFSET] * 32)), ir.VectorType(_I8, 32)),
                                    ir.VectorType(_I32, 8))
                for j in range(8):  # quad j of the block: 4 bytes at the lane's place of quad 8b + j
                    quad = builder.add(builder.mul(b, ir.Constant(_I64, 8)), ir.Constant(_I64, j))
                    at = builder.gep(u_row, [builder.mul(quad, ir.Constant(_I64, 4 * LANES))], inbounds=True)
                    builder.store(builder.extract_element(u, ir.Constant(_I32, j)),
                                  builder.bitcast(at, _I32.as_pointer()), align=1)
        return context.get_constant(types.int64, 0)

    def typer(typingctx, x, t, xu, xd, xsum, v, lane):
        f32, c = types.Array(types.float32, 2, "C"), "C"
        if not (x == xd == f32 and xu == types.Array(types.uint8, 2, c) and xsum == types.Array(types.int32, 2, c)
                and all(isinstance(i, types.Integer) for i in (t, v, lane))):
            return None
        return types.int64(x, t, xu, xd, xsum, v, lane), codegen

    typer.__name__ = f"int8_prompt_quantize_{block}"
    return intrinsic(typer)


_QUANTIZE_Q8_0 = _token_quantizer(_BLOCK, True)
_QUANTIZE_Q8_K = _token_quantizer(256, False)


def _max_tree(builder, v):
    """The largest element of a float vector, as a tree of vmaxps-like selects (llvm's reduce.fmax keeps
    maxnum's NaN rule, which x86 has no instruction for: a scalar chain)."""
    n = v.type.count
    while n > 1:
        low = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n // 2), list(range(n // 2))))
        high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n // 2), list(range(n // 2, n))))
        v = builder.select(builder.fcmp_ordered(">", low, high), low, high)
        n //= 2
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _quantize_vectors(x, k_quants, xu, xd, xsum):
    n = x.shape[0]
    for v in prange(xu.shape[0]):
        for lane in range(LANES):
            t = v * LANES + lane
            if t < n and k_quants:
                _QUANTIZE_Q8_K(x, t, xu, xd, xsum, v, lane)
            elif t < n:
                _QUANTIZE_Q8_0(x, t, xu, xd, xsum, v, lane)
            else:  # padding: zeros, at scale 0
                for j in range(lane, xd.shape[1], LANES):
                    xd[v, j] = 0
                for j in range(lane, xsum.shape[1], LANES):
                    xsum[v, j] = 0
                for j in range(xu.shape[1] // (4 * LANES)):
                    for k in range(4):
                        xu[v, 4 * LANES * j + 4 * lane + k] = _X_OFFSET


_QUANTIZE = Twin(_quantize_vectors, 1 << 16, fastmath=False)


# --------------------------------------------------------------------------------------------------
# the weights: a row unpacked to signed quants, a scale and an offset per group, and the group's
# vpdpbusd start (-128 x the sum of its quants); in IR, from the decode tiles' own readers of each
# block type (int8_dots' weight sides), so both read a block alike
# --------------------------------------------------------------------------------------------------
def _emit_unpack(builder, weight_side, unit_blocks, group, unsigned, row, cols, q_out, a_out, b_out, c_out):
    """Row `row` (a byte pointer) of one block type into its quants (signed, or as stored where
    `unsigned`, _UNSIGNED_QUANTS' entry, is given), scales, offsets and vpdpbusd starts."""
    units = builder.udiv(cols, ir.Constant(_I64, 32 * unit_blocks))
    with cgutils.for_range(builder, units) as loop:
        first = builder.mul(loop.index, ir.Constant(_I64, unit_blocks))
        unit = weight_side(builder, row, first)
        for k, q, kind, iscale in unit.chunks:
            block = builder.add(first, ir.Constant(_I64, k))
            if unsigned is not None:  # kept as stored: u, standing for u - offset
                assert kind == unsigned[0], (kind, unsigned)
            elif kind > 0:  # stored as u standing for u - kind
                q = builder.sub(q, ir.Constant(q.type, [kind] * 32))
            at = builder.gep(q_out, [builder.mul(block, ir.Constant(_I64, 32))], inbounds=True)
            builder.store(q, builder.bitcast(at, q.type.as_pointer()), align=1)
            wide = builder.sext(q, ir.VectorType(_I32, 32))
            for h in range(32 // group):
                g = builder.add(builder.mul(block, ir.Constant(_I64, 32 // group)), ir.Constant(_I64, h))
                if not _SIGNED_PAIRS:  # the vpdpbusd start (AVX2's accumulators start from 0)
                    part = builder.shuffle_vector(wide, wide, ir.Constant(ir.VectorType(_I32, group),
                                                                          list(range(group * h, group * h + group))))
                    total = _call(builder, f"llvm.vector.reduce.add.v{group}i32", _I32, part)
                    builder.store(builder.mul(total, ir.Constant(_I32, -128)), builder.gep(c_out, [g], inbounds=True))
                a, b = _scale_and_offset(builder, unit, k, iscale, 4 * h)
                builder.store(a, builder.gep(a_out, [g], inbounds=True))
                if b is not None:
                    builder.store(b, builder.gep(b_out, [g], inbounds=True))


@intrinsic
def _unpack_row(typingctx, tt, u8, r, ws, wa, wb, wc):
    """(tt, u8, r, ws, wa, wb, wc) -> 0: row r of the weight u8 [rows, row_bytes] of type code tt into ws
    int8 [cols], wa, wb float32 [cols / group] and wc int32 [cols / group]; one switch on the type,
    then that type's unit loop."""
    if not (isinstance(tt, types.Integer) and isinstance(u8, types.Array) and u8.ndim == 2
            and u8.dtype == types.uint8 and u8.layout == "C" and isinstance(r, types.Integer)
            and ws == types.Array(types.int8, 1, "C") and wa == wb == types.Array(types.float32, 1, "C")
            and wc == types.Array(types.int32, 1, "C")):
        return None

    def codegen(context, builder, sig, args):
        w, ws_, wa_, wb_, wc_ = (context.make_array(t)(context, builder, a) for t, a in
                                 zip((sig.args[1], *sig.args[3:]), (args[1], *args[3:])))
        r_ = builder.sext(args[2], _I64) if args[2].type.width < 64 else args[2]
        row = builder.gep(builder.bitcast(w.data, _I8.as_pointer()), [builder.mul(r_, builder.extract_value(w.strides, 0))],
                          inbounds=True)
        outs = (builder.bitcast(ws_.data, _I8.as_pointer()), builder.bitcast(wa_.data, _F32.as_pointer()),
                builder.bitcast(wb_.data, _F32.as_pointer()), builder.bitcast(wc_.data, _I32.as_pointer()))
        cols = builder.extract_value(ws_.shape, 0)
        code = builder.sext(args[0], _I64) if args[0].type.width < 64 else args[0]
        done = builder.append_basic_block("unpacked")
        switch = builder.switch(code, done)
        for ttype, (side, unit_blocks) in _READERS.items():
            case = builder.append_basic_block(f"unpack_{ttype.name.lower()}")
            switch.add_case(ir.Constant(_I64, int(ttype)), case)
            builder.position_at_end(case)
            _emit_unpack(builder, side, unit_blocks, _GROUP[ttype][0], _UNSIGNED_QUANTS.get(ttype), row, cols, *outs)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_constant(types.int64, 0)

    return types.int64(tt, u8, r, ws, wa, wb, wc), codegen


def _scale_and_offset(builder, unit, k, iscale, lane):
    """(a, b) of chunk k's values from lane `lane` of its scales (b None where the type has no offset):
    the float products the float rows (quant_matmul) dequantize with."""
    def lane_of(v, i):
        return builder.extract_element(v, ir.Constant(_I32, i))

    if iscale is None:  # a unit of 32-value blocks: d per block, Q4_1/Q5_1's -m as its mins
        b = None if unit.mins is None else builder.fneg(lane_of(unit.mins, k))
        return lane_of(unit.scales, k), b
    a = builder.fmul(unit.d, builder.sitofp(lane_of(iscale, lane), _F32))
    if unit.mins is not None:  # Q4_K, Q5_K: dmin * m_j per chunk
        return a, builder.fneg(lane_of(unit.mins, k))
    if unit.int_mins is not None:  # Q2_K: integer mins per 16 values, and dmin
        mins, dmin = unit.int_mins
        return a, builder.fneg(builder.fmul(dmin, builder.sitofp(lane_of(mins[k], lane), _F32)))
    return a, None


# each type's reader of a unit of blocks (int8_dots' weight sides) and the 32-value blocks it spans
_READERS = {
    TensorType.Q8_0: (int8_dots._blocks(34, int8_dots._q8_0_quants)(1), 1),
    TensorType.Q4_0: (int8_dots._blocks(18, int8_dots._q4_0_quants)(1), 1),
    TensorType.Q4_1: (int8_dots._blocks(20, int8_dots._q4_1_quants, has_min=True)(1), 1),
    TensorType.Q5_0: (int8_dots._blocks(22, int8_dots._q5_0_quants)(1), 1),
    TensorType.Q5_1: (int8_dots._blocks(24, int8_dots._q5_1_quants, has_min=True)(1), 1),
    TensorType.IQ4_NL: (int8_dots._blocks(18, int8_dots._iq4_nl_quants)(1), 1),
    TensorType.Q2_K: (int8_dots._q2_k, 8), TensorType.Q3_K: (int8_dots._q3_k, 8),
    TensorType.Q4_K: (int8_dots._k4(144, 16, False), 8), TensorType.Q5_K: (int8_dots._k4(176, 48, True), 8),
    TensorType.Q6_K: (int8_dots._q6_k, 8), TensorType.IQ4_XS: (int8_dots._iq4_xs, 8)}


# --------------------------------------------------------------------------------------------------
# the tile: 4 unpacked rows x every token vector, in IR
# --------------------------------------------------------------------------------------------------
def _splat(builder, value, vector_type):
    v = builder.insert_element(ir.Constant(vector_type, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


def _quads(builder, acc, x, w):
    """acc + per lane the sum of 4 products (x: 4 unsigned bytes a lane, w: 4 signed bytes a lane),
    exact: vpdpbusd, or the same integers portably."""
    if _VNNI:
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _VI32, acc, x, w)
    wide = ir.VectorType(_I32, 4 * LANES)
    v64 = ir.VectorType(_I8, 4 * LANES)
    prod = builder.mul(builder.zext(builder.bitcast(x, v64), wide), builder.sext(builder.bitcast(w, v64), wide))
    total = acc
    for k in range(4):
        lanes = ir.Constant(ir.VectorType(_I32, LANES), [4 * j + k for j in range(LANES)])
        total = builder.add(total, builder.shuffle_vector(prod, prod, lanes))
    return total


def signed_pairs(builder, x, w):
    """Per 32-bit lane of x (<32 x i8>: 8 lanes of 4 signed quants, |q| <= 127) the sum of its 4
    products with the weight quad w (i32: 4 signed bytes, the same in every lane), exact: <8 x i32>.
    w's magnitude is the same for every x (LLVM computes it once)."""
    wb = builder.bitcast(_splat(builder, w, _V8I32), _V32I8)
    return int8_dots._u8_s8_quads(builder, _call(builder, "llvm.x86.avx2.psign.b", _V32I8, wb, wb),
                                  _call(builder, "llvm.x86.avx2.psign.b", _V32I8, x, wb))


def _row_ptr(builder, array, row, elem):
    base = builder.bitcast(array.data, _I8.as_pointer())
    at = builder.gep(base, [builder.mul(row, builder.extract_value(array.strides, 0))], inbounds=True)
    return builder.bitcast(at, elem.as_pointer())


def _load(builder, ptr, index, vector_type=None, align=1):
    at = builder.gep(ptr, [index], inbounds=True)
    if vector_type is None:
        return builder.load(at, align=align)
    return builder.load(builder.bitcast(at, vector_type.as_pointer()), align=align)


def _tile_variant(ttype: TensorType) -> tuple[int, bool, int, int]:
    """(group, has_min, run, offset) of the tile that multiplies `ttype`'s unpacked rows: run > 0 where
    its quants stay unsigned (AVX2: quads summed in int16 `run` at a time, `offset` the stored offset)."""
    group, has_min = _GROUP[ttype]
    if ttype not in _UNSIGNED_QUANTS:
        return group, has_min, 0, 0
    offset, top = _UNSIGNED_QUANTS[ttype]
    run = 1
    while 2 * run * 2 * top * 127 <= 32767 and 2 * run <= group // 4:  # int16 sums stay exact
        run *= 2
    return group, has_min, run, offset


def _emit_tile(builder, variant, arrays, i, v0):
    """Rows i..i+3 of the unpacked weights (ws int8 [16, cols], wa/wb float32 and wc int32 [16, cols /
    group]) times token vectors v0, v0 + 1 of the activations (as many as there are), into res."""
    group, has_min, run, offset = variant
    quads = group // 4
    ws, wa, wb, wc, xu, xd, xsum, res = arrays
    rows = [builder.add(i, ir.Constant(_I64, r)) for r in range(_TILE_ROWS)]
    w_rows = [_row_ptr(builder, ws, r, _I32) for r in rows]  # quads of 4 int8 as i32
    a_rows, b_rows = ([_row_ptr(builder, arr, r, _F32) for r in rows] for arr in (wa, wb))
    c_rows = [_row_ptr(builder, wc, r, _I32) for r in rows]
    res_rows = [_row_ptr(builder, res, r, _F32) for r in rows]
    groups = builder.extract_value(wa.shape, 1)
    vectors = builder.extract_value(xu.shape, 0)
    accs = [[cgutils.alloca_once(builder, _VF32) for _ in range(_TILE_VECTORS)] for _ in range(_TILE_ROWS)]

    def tile(v0, count):
        x_rows = [_row_ptr(builder, xu, builder.add(v0, ir.Constant(_I64, g)), _VI32) for g in range(count)]
        d_rows = [_row_ptr(builder, xd, builder.add(v0, ir.Constant(_I64, g)), _VF32) for g in range(count)]
        s_rows = [_row_ptr(builder, xsum, builder.add(v0, ir.Constant(_I64, g)), _VI32) for g in range(count)]
        for row in accs:
            for g in range(count):
                builder.store(ir.Constant(_VF32, [0.0] * LANES), row[g])
        with cgutils.for_range(builder, groups) as loop:
            k = loop.index
            if run:
                start = builder.mul(_group_sums(builder, s_rows[0], k, group), ir.Constant(_VI32, [-offset] * LANES))
                ints = [[total] for total in _unsigned_dots(builder, k, quads, run, w_rows, x_rows[0], start)]
            elif _SIGNED_PAIRS:
                ints = [[total] for total in _signed_dots(builder, k, quads, w_rows, x_rows[0])]
            else:
                ints = [[_splat(builder, _load(builder, c, k), _VI32)] * count for c in c_rows]
                for j in range(quads):
                    q = builder.add(builder.mul(k, ir.Constant(_I64, quads)), ir.Constant(_I64, j))
                    xv = [_load(builder, x, q, align=1) for x in x_rows]
                    for r in range(_TILE_ROWS):
                        wv = _splat(builder, _load(builder, w_rows[r], q), _VI32)
                        ints[r] = [_quads(builder, ints[r][g], xv[g], wv) for g in range(count)]
            block = builder.udiv(builder.mul(k, ir.Constant(_I64, group)), ir.Constant(_I64, _BLOCK))
            dx = [_load(builder, d, block, align=4) for d in d_rows]
            sums = ([builder.fmul(dx[g], builder.sitofp(_group_sums(builder, s, k, group), _VF32))
                     for g, s in enumerate(s_rows)] if has_min else None)
            for r in range(_TILE_ROWS):
                a = _splat(builder, _load(builder, a_rows[r], k, align=4), _VF32)
                b = _splat(builder, _load(builder, b_rows[r], k, align=4), _VF32) if has_min else None
                for g in range(count):
                    acc = builder.load(accs[r][g])
                    scale = builder.fmul(a, dx[g])
                    acc = _call(builder, "llvm.fma.v16f32", _VF32, scale, builder.sitofp(ints[r][g], _VF32), acc)
                    if has_min:
                        acc = _call(builder, "llvm.fma.v16f32", _VF32, b, sums[g], acc)
                    builder.store(acc, accs[r][g])
        for r in range(_TILE_ROWS):
            for g in range(count):
                at = builder.mul(builder.add(v0, ir.Constant(_I64, g)), ir.Constant(_I64, LANES))
                ptr = builder.bitcast(builder.gep(res_rows[r], [at], inbounds=True), _VF32.as_pointer())
                builder.store(builder.load(accs[r][g]), ptr, align=4)

    left = builder.sub(vectors, v0)
    if _SIGNED_PAIRS:  # one token vector at a time: its 4 rows x 2 halves of sums fill AVX2's registers
        tile(v0, 1)
        with builder.if_then(builder.icmp_unsigned(">=", left, ir.Constant(_I64, 2))):
            tile(builder.add(v0, ir.Constant(_I64, 1)), 1)
        return

    def tiles(count):  # a whole tile, or the last vectors of the call
        if count == 1:
            tile(v0, 1)
            return
        with builder.if_else(builder.icmp_unsigned(">=", left, ir.Constant(_I64, count))) as (whole, fewer):
            with whole:
                tile(v0, count)
            with fewer:
                tiles(count - 1)

    tiles(_TILE_VECTORS)


def _group_sums(builder, s_row, k, group):
    """<16 x i32>: per token, the sum of group k's activation quants (from the sums per 16 values)."""
    if group == 16:
        return _load(builder, s_row, k, align=4)
    first = builder.mul(k, ir.Constant(_I64, 2))
    return builder.add(_load(builder, s_row, first, align=4),
                       _load(builder, s_row, builder.add(first, ir.Constant(_I64, 1)), align=4))


def _row_halves(builder, x_row, rows):
    """Per row, a pointer to the token vector's 256-bit halves. Each row reads the vector through a
    pointer of its own that LLVM cannot see is the same: merged, the loads were hoisted, their 16
    vectors held for the 4 rows, and spilled."""
    return [builder.bitcast(builder.gep(x_row, [_opaque_zero(builder)], inbounds=True), _V32I8.as_pointer())
            for _ in range(rows)]


def _half_at(builder, halves, q, h):
    return _load(builder, halves, builder.add(builder.mul(q, ir.Constant(_I64, 2)), ir.Constant(_I64, h)))


def _signed_dots(builder, k, quads, w_rows, x_row):
    """Per row, the exact dots of group k's signed weight quants with one token vector's signed
    activations (<16 x i32>), in AVX2: llama.cpp's signed pairs, |w| times x with w's sign."""
    halves = _row_halves(builder, x_row, len(w_rows))
    totals = []
    for r, w_row in enumerate(w_rows):
        sums = [None, None]
        for j in range(quads):
            q = builder.add(builder.mul(k, ir.Constant(_I64, quads)), ir.Constant(_I64, j))
            w = _load(builder, w_row, q)
            for h in range(2):
                p = signed_pairs(builder, _half_at(builder, halves[r], q, h), w)
                sums[h] = p if sums[h] is None else builder.add(sums[h], p)
        totals.append(builder.shuffle_vector(sums[0], sums[1], ir.Constant(_VI32, list(range(LANES)))))
    return totals


def _unsigned_dots(builder, k, quads, run, w_rows, x_row, start):
    """Per row, start + the exact dots of group k's unsigned weight quants with one token vector's
    signed activations (<16 x i32>), in AVX2: vpmaddubsw's int16 pair sums add up over `run` quads
    (exact: _tile_variant bounds them) before one vpmaddwd widens them."""
    halves = _row_halves(builder, x_row, len(w_rows))
    ones = ir.Constant(_V16I16, [1] * 16)
    totals = [start] * len(w_rows)
    for first in range(0, quads, run):
        pairs = [[None, None] for _ in w_rows]
        for j in range(first, first + run):
            q = builder.add(builder.mul(k, ir.Constant(_I64, quads)), ir.Constant(_I64, j))
            for r, w_row in enumerate(w_rows):
                wb = builder.bitcast(_splat(builder, _load(builder, w_row, q), _V8I32), _V32I8)
                for h in range(2):
                    p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, wb, _half_at(builder, halves[r], q, h))
                    pairs[r][h] = p if pairs[r][h] is None else builder.add(pairs[r][h], p)
        for r in range(len(w_rows)):
            wide = [_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, pairs[r][h], ones) for h in range(2)]
            totals[r] = builder.add(totals[r], builder.shuffle_vector(wide[0], wide[1],
                                                                      ir.Constant(_VI32, list(range(LANES)))))
    return totals


def _opaque_zero(builder):
    """An i64 0 the optimizer cannot see through (an empty inline asm hands it over)."""
    return builder.asm(ir.FunctionType(_I64, [_I64]), "", "=r,0", [ir.Constant(_I64, 0)], False)


_TILES = tuple(sorted({_tile_variant(t) for t in _GROUP}))  # the tile variants this CPU's types take
_TILE_OF = np.full(max(TensorType) + 1, -1, np.int64)
for _t in _GROUP:
    _TILE_OF[_t] = _TILES.index(_tile_variant(_t))


@intrinsic
def _rows_tile(typingctx, variant, ws, wa, wb, wc, i, xu, xd, xsum, res, v0):
    """(variant, ws, wa, wb, wc, i, xu, xd, xsum, res, v0) -> 0: res[i + r, 16 v .. 16 v + 15] = rows
    i..i+3 of the unpacked weights times token vector v of the activations, for v = v0 and v0 + 1 (where
    there is one): one switch on the variant (an index into _TILES), then that variant's tile."""
    f32, c = types.Array(types.float32, 2, "C"), "C"
    if not (isinstance(variant, types.Integer) and ws == types.Array(types.int8, 2, c) and wa == wb == xd == res == f32
            and wc == xsum == types.Array(types.int32, 2, c) and xu == types.Array(types.uint8, 2, c)
            and isinstance(i, types.Integer) and isinstance(v0, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args)
                  if isinstance(t, types.Array)]
        i_, v0_, code = (builder.sext(a, _I64) if a.type.width < 64 else a for a in (args[5], args[10], args[0]))
        done = builder.append_basic_block("tiled")
        switch = builder.switch(code, done)
        for index, variant in enumerate(_TILES):
            case = builder.append_basic_block(f"tile_{index}")
            switch.add_case(ir.Constant(_I64, index), case)
            builder.position_at_end(case)
            _emit_tile(builder, variant, arrays, i_, v0_)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_constant(types.int64, 0)

    return types.int64(variant, ws, wa, wb, wc, i, xu, xd, xsum, res, v0), codegen


# --------------------------------------------------------------------------------------------------
# the driver: activations quantized in parallel, then 16 rows per work item
# --------------------------------------------------------------------------------------------------
def _product(tt, u8, xu, xd, xsum, group, variant, out):
    n, rows = out.shape
    cols = xu.shape[1] // LANES
    groups = cols // group
    for c in prange((rows + _CHUNK_ROWS - 1) // _CHUNK_ROWS):
        r0 = c * _CHUNK_ROWS
        nr = min(_CHUNK_ROWS, rows - r0)
        ws = np.zeros((_CHUNK_ROWS, cols), np.int8)
        wa = np.zeros((_CHUNK_ROWS, groups), np.float32)
        wb = np.zeros((_CHUNK_ROWS, groups), np.float32)
        wc = np.zeros((_CHUNK_ROWS, groups), np.int32)
        res = np.empty((_CHUNK_ROWS, xu.shape[0] * LANES), np.float32)
        for i in range(nr):
            _unpack_row(tt, u8, r0 + i, ws[i], wa[i], wb[i], wc[i])
        for v in range(0, xu.shape[0], _TILE_VECTORS):  # a pair of token vectors meets every row of the chunk
            for i in range(0, nr, _TILE_ROWS):  # rows past nr are zeros: their results are left unread
                _rows_tile(variant, ws, wa, wb, wc, i, xu, xd, xsum, res, v)
        for t in range(n):
            for i in range(nr):
                out[t, r0 + i] = res[i, t]


_PRODUCT = Twin(_product, 1 << 17, fastmath=False)
