"""Batched decode rows in token lanes: the decode tiles' results, bit for bit, for a fraction of the work.

This module owns the product of a step's decode rows (MIN_TOKENS to any number of tokens) with a
weight of a 32-value block type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), laid out as int8_prompt lays
out prompt rows: tokens across the lanes of a vector, no horizontal sum and no per-token conversion
inside a block. A 256-bit vector holds one row's products with 8 tokens. With AVX-512 VNNI each
weight quad, broadcast to the lanes from memory, is vpdpbusd's signed operand against the tokens'
quads plus 128; with AVX2 alone, in llama.cpp's signed pairs (vpsignb, vpmaddubsw, vpmaddwd:
2048 x 768 Q8_0, 8 tokens, one thread, 0.30 ms against the tiles' 0.44). The decode tiles (int8_dots)
reduce each block's 8 int32 lanes to one sum per token and convert it alone: at 8 tokens that was
most of a step's time (8 streams decoded at 2.6-3.1x one stream's tokens/s on the 100M Q8_0 file).

Why it is exact: a decode row's result must not depend on its batch (tests/test_decoder_layer.py),
so these lanes compute what the decode tile computes for the same token, in the same order:
- the same activations: the decode rows' own q8_0 quants and scales, put into lanes once per input
  by put_token (not quantized again; with VNNI stored plus 128, q xor 0x80, vpdpbusd's unsigned
  operand);
- each block's exact integer dot: with VNNI the token's quants plus 128 times the weight's, plus
  -128 x the weight block's quant sum (computed beside the block, _Rows.prepare), which takes off
  what the + 128 added; with AVX2 the weight's signed quants broadcast from memory against the
  token's in signed pairs;
- the same float steps: value = float(dot) * (d * xd), added to the accumulator of the block's place
  in its unit of 4 (tail blocks to the first), Q4_1/Q5_1's (-m) * xs to the mins' four, and the
  result (a0 + a2) + (a1 + a3) minus the mins' sum alike (int8_dots._hsum), strict IEEE.
Why it reads the way it does:
- One row's 8 tokens in a 256-bit vector, the weight quad broadcast into vpdpbusd from memory (no
  other operation a quad), not two rows' in the halves of a 512-bit vector (the version before),
  where each quad of both rows cost a zmm shuffle beside its vpdpbusd (12 shuffles a block of both
  rows, the weight plus 128 as the unsigned operand, the tokens' sums taking it off). 2048 x 768
  Q8_0, 8 tokens, one thread, Zen 4, alternated in one process: 172-184 us against 218 with the
  weight read from DRAM (48 copies of it), 134-143 against 153-165 from L3. The weight's plus 128
  (q xor 0x80 a quad, or stored xor-ed and loaded back) cost more than the block sums do. Before the
  halves, 15 tokens of one row and a zero token in lane 15 of a 512-bit vector left half the lanes
  empty at 8 tokens.
- Q8_0 blocks are read in place, the weight streaming from DRAM while the products run. A tile's 4
  rows are the quarters of the row group rows() is given (rows r, r + q, r + 2q, r + 3q), not 4
  adjacent rows: 4 adjacent rows' blocks, taken in turn, are 4 streams 816 bytes apart (768 columns)
  that the hardware prefetcher did not follow (the access pattern alone, no products: 9.7 GB/s on one
  thread against 31-35 GB/s read in order; quarters of 32 rows 15.5, of 256 rows 27.7). The other
  types are unpacked (by the decode tiles' own block readers) a tile's rows at a time: unpacking a
  group of 32 rows first and multiplying after stopped the stream for the products, and a 32000-row
  head ran at half the decode tile's bandwidth.
K-quants keep the decode tiles: their decode lanes sum 8 int32 partials per token in float, which
lanes of tokens cannot reproduce without 8 accumulators per token.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ember.kernels.cpu import int8_dots
from ember.kernels.cpu.int8_dots import _VNNI, SIGNED, UNSIGNED, _at, _call, _i64
# the same broadcast, and AVX2's signed pairs
from ember.kernels.cpu.int8_prompt import _SIGNED_PAIRS, _splat, signed_pairs
from ember.kernels.tensor_types import TensorType

__all__ = ["TOKENS", "MIN_TOKENS", "LANE_TYPES", "room", "room_for", "tokens_in", "tokens_per_thread", "put_token",
           "rows"]

# With AVX2 but no VNNI the products are llama.cpp's signed pairs (int8_prompt.signed_pairs): the same
# integers as vpdpbusd's, with no offset to take off. 16 lanes there, half of them empty at 8 tokens,
# ran slower than the decode tiles (2048 x 768 Q8_0, 8 tokens, one thread: 0.59 against 0.44 ms).
_SIGNED = _SIGNED_PAIRS
LANES = TOKENS = 8  # int32 lanes of a 256-bit vector, one token each
# Fewest decode rows that take the lanes, and fewest in a last vector (a speed choice only: both give
# the same bits). AVX2's vector costs what 5.5 tokens cost in the decode tiles (2048 x 768 Q8_0, one
# thread: 0.29-0.30 ms against 0.055 ms a token). With neither VNNI nor AVX2 never: products written
# portably are slower than the decode tiles.
MIN_TOKENS = 4 if _VNNI else 6 if _SIGNED else 1 << 30
LANE_TYPES = frozenset((TensorType.Q8_0, TensorType.Q4_0, TensorType.Q4_1, TensorType.Q5_0, TensorType.Q5_1,
                        TensorType.IQ4_NL))
_BLOCK = 32
_UNIT = 4  # blocks per unit of the decode tiles (int8_dots._Q8_0_LANES): the 4 float accumulators
_TILE_ROWS = 4  # rows per tile: 4 accumulators a row, 8 activation vectors
_TILE_ROWS_MIN = 2  # with mins: 4 more accumulators a row
# Rows ahead that a tile prefetches: one row group on (quant_matmul._MATVEC_ROWS, 32: rows() takes a
# group's quarters, and a thread's next group is the next 32 rows, team.claim's contiguous shares),
# the same quarter's row there. Its 4 rows' blocks interleaved are 4 streams for the hardware
# prefetcher, and without a hint the products waited on DRAM. 65536 x 768 Q8_0 (53 MB), 8 tokens, one
# thread, alternated in one process: adjacent rows 16 ahead 6.4 ms; quarters of 32-row groups 16 ahead
# 4.9-5.0, 32 ahead 4.0 (13.3 GB/s; from L3 the same rows take ~3.7); 24576 x 2048: 4.3, 4.2-4.3, 3.7.
_PREFETCH_ROWS = 32
_CHAINS = 2  # independent integer sums a row and block (one chain of 8 vpdpbusd: 10-15% slower)
# per value of a row: LANES quants, per 32 values LANES x (scale, block sum, an int32 of the block's
# quants' sum: with AVX2 the offset's share of a weight stored with an offset) x 4 bytes
_LANE_BYTES = LANES * 11 // 8
_X_FLIP = np.int32(0 if _SIGNED else -0x7F7F7F80)  # with VNNI each quant plus 128: q xor 0x80
_Q8_0, _Q4_0, _Q4_1 = int(TensorType.Q8_0), int(TensorType.Q4_0), int(TensorType.Q4_1)
_Q5_0, _Q5_1 = int(TensorType.Q5_0), int(TensorType.Q5_1)


@njit(inline="always", cache=True, nogil=True)
def room(n, cols):
    """Room for the first of n decode tokens that take the lanes: every whole vector's, and the last
    vector's if it has MIN_TOKENS or more; none below MIN_TOKENS in all. The rest take the decode
    tiles (tokens_in)."""
    rest = n % TOKENS
    return room_for(n - rest + (rest if rest >= MIN_TOKENS else 0) if n >= MIN_TOKENS else 0, cols)


@njit(inline="always", cache=True, nogil=True)
def tokens_in(lanes, n):
    """How many of n tokens, the first, `lanes` (room) holds."""
    return min(n, lanes.shape[0] * TOKENS)


@njit(inline="always", cache=True, nogil=True)
def room_for(n, cols):
    """Room for n decode tokens' q8_0 activations in lanes: uint8 [vectors, _LANE_BYTES cols], each
    vector holding, for its TOKENS tokens (token l in lane l),
    the quants, signed with AVX2 and plus 128 (unsigned) with VNNI (quad c of lane l at byte
    4 (LANES c + l)), then per 32-value block b LANES float32 scales at LANES (cols + 4 b), LANES
    float32 block sums (xs) at LANES (9 cols / 8 + 4 b) and LANES int32 quant sums at LANES
    (5 cols / 4 + 4 b; written with AVX2 alone, the only lanes that read them). put_token fills a
    vector's every lane it reads, so only a vector with lanes past the n tokens is zeroed (their
    results are never stored, but garbage floats there could be slow denormals): zeroing every room
    wrote ~5 MB a step of 8 streams on the 100M model."""
    vectors = (n + TOKENS - 1) // TOKENS
    lanes = np.empty((vectors, cols * _LANE_BYTES), np.uint8)
    if n % TOKENS:
        lanes[vectors - 1] = 0
    return lanes


@njit(inline="always", cache=True, nogil=True)
def tokens_per_thread(lanes):
    """Tokens one thread should quantize together into a room whose lanes are `lanes`: one, or with
    tokens in lanes half a vector's, so that two threads share a step's 8 (a vector's on one thread
    kept the other waiting: 8 tokens of 2048 values take ~25 us to quantize, a layer of the 100M
    model ~60)."""
    return TOKENS // 2 if lanes.shape[0] > 0 else 1


@njit(inline="always", cache=True, nogil=True)
def put_token(xq, xd, xs, t, lanes):
    """Token t's decode activations (int8_dots.quantize_activation's xq [cols], xd, xs [cols / 32])
    into its lane of `lanes` (room), if the room has one -> whether it had (a token in lanes never
    meets the decode tiles, which need the quad offsets)."""
    if t >= lanes.shape[0] * TOKENS:
        return False
    cols = xq.shape[0]
    blocks = cols // _BLOCK
    row = lanes[t // TOKENS]
    quads = row[:LANES * cols].view(np.int32)
    floats = row[LANES * cols:LANES * cols * 5 // 4].view(np.float32)
    sums = row[LANES * cols * 5 // 4:_LANE_BYTES * cols].view(np.int32)
    lane = t % TOKENS
    _put_quads(xq, quads, lane)
    for b in range(blocks):
        floats[LANES * b + lane] = xd[b]
        floats[LANES * (blocks + b) + lane] = xs[b]
        if _SIGNED:  # only AVX2's lanes take an offset's share off (_signed_block)
            total = 0
            for j in range(b * _BLOCK, (b + 1) * _BLOCK):
                total += np.int32(xq[j])
            sums[LANES * b + lane] = total
    return True


_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VI32, _VF32, _VI8 = ir.VectorType(_I32, LANES), ir.VectorType(_F32, LANES), ir.VectorType(_I8, 4 * LANES)


@intrinsic
def _put_quads(typingctx, xq, quads, lane):
    """quads[LANES c + lane] = quad c of xq (int8 [cols], cols a multiple of 32) xor _X_FLIP, for every
    c: 8 quads a vector load, then 8 scalar stores. Written as a numba loop, LLVM made it a
    vpscatterqd per 8 quads, which Zen 4 runs slowly (6% of the fused layer's time at 8 streams)."""
    if xq != types.Array(types.int8, 1, "C") or quads != types.Array(types.int32, 1, "C") \
            or not isinstance(lane, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        xq = context.make_array(sig.args[0])(context, builder, args[0])
        src = builder.bitcast(xq.data, _VI32.as_pointer())
        xq_len = builder.extract_value(xq.shape, 0)
        dst = builder.bitcast(context.make_array(sig.args[1])(context, builder, args[1]).data, _I32.as_pointer())
        lane = _i64(builder, args[2])
        flip = ir.Constant(_VI32, [int(_X_FLIP)] * LANES)
        with cgutils.for_range(builder, builder.udiv(xq_len, ir.Constant(_I64, 4 * LANES))) as loop:
            v = builder.xor(builder.load(builder.gep(src, [loop.index], inbounds=True), align=1), flip)
            first = builder.add(builder.mul(loop.index, ir.Constant(_I64, LANES * LANES)), lane)
            for k in range(LANES):
                at = builder.add(first, ir.Constant(_I64, LANES * k))
                builder.store(builder.extract_element(v, ir.Constant(_I32, k)),
                              builder.gep(dst, [at], inbounds=True), align=4)
        return context.get_dummy_value()

    return types.none(xq, quads, lane), codegen


# --------------------------------------------------------------------------------------------------
# the weights: Q8_0 in place; the others unpacked into quants, a scale and a (negated) min
# --------------------------------------------------------------------------------------------------
# each unpacked type: its block bytes, its quant reader (int8_dots) and whether it has mins
_UNPACKED = {TensorType.Q4_0: (18, int8_dots._q4_0_quants, False), TensorType.Q4_1: (20, int8_dots._q4_1_quants, True),
             TensorType.Q5_0: (22, int8_dots._q5_0_quants, False), TensorType.Q5_1: (24, int8_dots._q5_1_quants, True),
             TensorType.IQ4_NL: (18, int8_dots._iq4_nl_quants, False)}


def _emit_unpack(builder, side, size, row, stride, first, ws, wa, wm):
    """The unit at block `first` of a row (blocks of `size` bytes) into ws (signed quants; with AVX2
    the stored u of a type with an offset, which the tile takes off), wa and wm (each block's scale and
    -min, as the decode tiles read them)."""
    _prefetch(builder, _at(builder, row, builder.mul(first, ir.Constant(_I64, size))), stride)
    unit = side(builder, row, first)
    for k, q, kind, _ in unit.chunks:
        if kind > UNSIGNED and not _SIGNED:  # stored as u standing for u - kind
            q = builder.sub(q, int8_dots._splat_i8(kind))
        b = builder.add(first, ir.Constant(_I64, k))
        at = builder.gep(ws, [builder.mul(b, ir.Constant(_I64, _BLOCK))], inbounds=True)
        builder.store(q, builder.bitcast(at, q.type.as_pointer()), align=1)
        builder.store(builder.extract_element(unit.scales, ir.Constant(_I32, k)), builder.gep(wa, [b], inbounds=True))
        if unit.mins is not None:
            builder.store(builder.extract_element(unit.mins, ir.Constant(_I32, k)), builder.gep(wm, [b], inbounds=True))


@intrinsic
def _unpack_row(typingctx, tt, u8, r, ws, wa, wm):
    """(tt, u8, r, ws, wa, wm) -> 0: row r of the weight u8 [rows, row_bytes] of type code tt (one of
    _UNPACKED) into ws int8 [cols], wa and wm float32 [cols / 32]; one switch on the type, then that
    type's loop over units of 4 blocks and the tail."""
    if not (isinstance(tt, types.Integer) and isinstance(u8, types.Array) and u8.ndim == 2 and u8.dtype == types.uint8
            and u8.layout == "C" and isinstance(r, types.Integer) and ws == types.Array(types.int8, 1, "C")
            and wa == wm == types.Array(types.float32, 1, "C")):
        return None

    def codegen(context, builder, sig, args):
        w, ws_, wa_, wm_ = (context.make_array(t)(context, builder, a) for t, a in
                            zip((sig.args[1], *sig.args[3:]), (args[1], *args[3:])))
        stride = builder.extract_value(w.strides, 0)
        row = _at(builder, builder.bitcast(w.data, _I8.as_pointer()), builder.mul(_i64(builder, args[2]), stride))
        outs = (builder.bitcast(ws_.data, _I8.as_pointer()), builder.bitcast(wa_.data, _F32.as_pointer()),
                builder.bitcast(wm_.data, _F32.as_pointer()))
        blocks = builder.udiv(builder.extract_value(ws_.shape, 0), ir.Constant(_I64, _BLOCK))
        whole = builder.udiv(blocks, ir.Constant(_I64, _UNIT))
        done = builder.append_basic_block("unpacked")
        switch = builder.switch(_i64(builder, args[0]), done)
        for ttype, (size, quants, has_min) in _UNPACKED.items():
            case = builder.append_basic_block(f"unpack_{ttype.name.lower()}")
            switch.add_case(ir.Constant(_I64, int(ttype)), case)
            builder.position_at_end(case)
            unit_side, tail_side = (int8_dots._blocks(size, quants, has_min)(k) for k in (_UNIT, 1))
            with cgutils.for_range(builder, whole) as loop:
                _emit_unpack(builder, unit_side, size, row, stride, builder.mul(loop.index, ir.Constant(_I64, _UNIT)), *outs)
            tail = builder.mul(whole, ir.Constant(_I64, _UNIT))
            with cgutils.for_range(builder, builder.sub(blocks, tail)) as loop:
                _emit_unpack(builder, tail_side, size, row, stride, builder.add(tail, loop.index), *outs)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_constant(types.int64, 0)

    return types.int64(tt, u8, r, ws, wa, wm), codegen


def _prefetch(builder, at, stride):
    """A hint: the bytes at `at`, _PREFETCH_ROWS rows of `stride` bytes on, into L1."""
    ahead = _at(builder, at, builder.mul(stride, ir.Constant(_I64, _PREFETCH_ROWS)))
    _call(builder, "llvm.prefetch.p0i8", ir.VoidType(), ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3),
          ir.Constant(_I32, 1))


class _Rows:
    """A tile's R rows of a weight. With VNNI, prepare() computes each block's -128 x its quants' sum
    (the correction: the tokens' quants are stored plus 128) just before the block is multiplied."""

    has_min = False

    def __init__(self, builder, R):
        self.builder, self.R = builder, R
        self.corrections = None

    def prepare(self, b):
        """With VNNI, the corrections of block b of every row: one vpdpbusd of the block's quants by 128
        each, and a tree of vphaddd for the rows together (_lane_totals), kept in a register; each row's
        is broadcast from it where its chains are added (_vnni_blocks). Stored to a scratch behind an
        empty asm instead, and loaded back a row at a time as the first chain's start, the tile ran 16%
        slower (2048 x 768 Q8_0, 8 tokens, one thread, alternated in one process: 134-137 us against
        112-114; the chains then waited on the sums' vphaddd, a store and its reload)."""
        if _SIGNED:
            return
        builder = self.builder
        flip = builder.bitcast(_splat(builder, ir.Constant(_I32, -0x7F7F7F80), _VI32), _VI8)  # 128 in each byte
        sums = [int8_dots._u8_s8_quads(builder, flip, builder.bitcast(self.quads(i, b), _VI8)) for i in range(self.R)]
        totals = _lane_totals(builder, sums)
        self.corrections = builder.sub(ir.Constant(totals.type, [0] * totals.type.count), totals)

    def correction(self, i):
        """-128 x the quants' sum of the prepared block of row i."""
        return self.builder.extract_element(self.corrections, ir.Constant(_I32, i))


class _InPlace(_Rows):
    """Q8_0 rows read in the file's blocks (34 bytes: d f16, 32 int8 quants)."""

    offset = SIGNED

    def __init__(self, builder, context, sig, args, R):
        super().__init__(builder, R)
        w = context.make_array(sig.args[0])(context, builder, args[0])
        r, step = _i64(builder, args[1]), _i64(builder, args[2])
        self.stride = builder.extract_value(w.strides, 0)
        base = builder.bitcast(w.data, _I8.as_pointer())
        self.rows = [_at(builder, base, builder.mul(builder.add(r, builder.mul(step, ir.Constant(_I64, i))), self.stride))
                     for i in range(R)]

    def _block(self, i, b):
        return _at(self.builder, self.rows[i], self.builder.mul(b, ir.Constant(_I64, 34)))

    def word(self, i, b, j):
        return self.builder.load(self.builder.bitcast(_at(self.builder, self._block(i, b), 2 + 4 * j), _I32.as_pointer()),
                                 align=1)

    def quads(self, i, b):
        """Block b's 32 quants as <8 x i32>."""
        return self.builder.load(self.builder.bitcast(_at(self.builder, self._block(i, b), 2), _VI32.as_pointer()), align=1)

    def scale(self, i, b):
        """Block b's scale in every lane, once a row and block: the f16 bits broadcast, then widened
        (vpbroadcastw, vcvtph2ps: one instruction fewer than widened, then broadcast); also where the
        same block _PREFETCH_ROWS rows on is asked for."""
        builder = self.builder
        _prefetch(builder, self._block(i, b), self.stride)
        bits = builder.load(builder.bitcast(self._block(i, b), ir.IntType(16).as_pointer()), align=1)
        halves = builder.bitcast(_splat(builder, bits, ir.VectorType(ir.IntType(16), LANES)),
                                 ir.VectorType(ir.HalfType(), LANES))
        return builder.fpext(halves, _VF32)


class _Unpacked(_Rows):
    """Rows unpacked by _unpack_row: ws int8 [rows, cols], wa and wm float32 [rows, cols / 32]."""

    def __init__(self, builder, context, sig, args, R, has_min, offset):
        super().__init__(builder, R)
        ws, wa, wm = (context.make_array(sig.args[k])(context, builder, args[k]) for k in range(3))
        i = _i64(builder, args[3])
        self.has_min, self.offset = has_min, offset

        def row_of(array, elem, k):
            at = builder.mul(builder.add(i, ir.Constant(_I64, k)), builder.extract_value(array.strides, 0))
            return builder.bitcast(_at(builder, builder.bitcast(array.data, _I8.as_pointer()), at), elem.as_pointer())

        self.w = [row_of(ws, _I32, k) for k in range(R)]  # quads of 4 int8 as i32
        self.a, self.m = ([row_of(arr, _F32, k) for k in range(R)] for arr in (wa, wm))

    def word(self, i, b, j):
        at = self.builder.add(self.builder.mul(b, ir.Constant(_I64, 8)), ir.Constant(_I64, j))
        return self.builder.load(self.builder.gep(self.w[i], [at], inbounds=True), align=4)

    def quads(self, i, b):
        at = self.builder.gep(self.w[i], [self.builder.mul(b, ir.Constant(_I64, 8))], inbounds=True)
        return self.builder.load(self.builder.bitcast(at, _VI32.as_pointer()), align=4)

    def scale(self, i, b):
        return _splat(self.builder, self.builder.load(self.builder.gep(self.a[i], [b], inbounds=True), align=4), _VF32)

    def minus_min(self, i, b):
        return self.builder.load(self.builder.gep(self.m[i], [b], inbounds=True), align=4)


def _lane_totals(builder, vectors):
    """<4 x i32>: the lane sums of up to 4 `vectors` (<8 x i32> each) in their order, then zeros. With
    AVX2 a tree of 3 vphaddd (lane l of phadd(a, b), per 128 bits: a's pairs, then b's) and an add of
    its halves, not 4 reductions of 3 shuffles and adds each."""
    zero = ir.Constant(_VI32, [0] * LANES)
    group = vectors + [zero] * (4 - len(vectors))
    if not int8_dots._AVX2:
        total = ir.Constant(ir.VectorType(_I32, 4), [0] * 4)
        for k, v in enumerate(vectors):
            total = builder.insert_element(total, _call(builder, "llvm.vector.reduce.add.v8i32", _I32, v), ir.Constant(_I32, k))
        return total
    while len(group) > 1:
        group = [_call(builder, "llvm.x86.avx2.phadd.d", _VI32, group[k], group[k + 1]) for k in range(0, len(group), 2)]
    low, high = (builder.shuffle_vector(group[0], group[0], ir.Constant(ir.VectorType(_I32, 4), list(range(h, h + 4))))
                 for h in (0, 4))  # the 4 sums of lanes 0-3, of lanes 4-7
    return builder.add(low, high)


# --------------------------------------------------------------------------------------------------
# the tile: R rows x one vector of 8 tokens, in IR
# --------------------------------------------------------------------------------------------------
def _emit_tile(builder, source, R, lanes, v, n, out, r0, step):
    """out[t, r0 + i step] for i < R and the tokens t < n of vector v of `lanes`: the rows of `source`
    (_InPlace or _Unpacked) against them, block by block in the decode tile's float order."""
    vec = _at(builder, builder.bitcast(lanes.data, _I8.as_pointer()), builder.mul(v, builder.extract_value(lanes.strides, 0)))
    cols = builder.udiv(builder.extract_value(lanes.shape, 1), ir.Constant(_I64, _LANE_BYTES))
    blocks = builder.udiv(cols, ir.Constant(_I64, _BLOCK))
    quads = builder.bitcast(vec, _VI32.as_pointer())

    def lane_floats(eighths, b, vector_type=_VF32):  # the lanes from byte LANES (cols eighths / 8 + 4 b) on
        at = builder.add(builder.mul(cols, ir.Constant(_I64, LANES * eighths // 8)),
                         builder.mul(b, ir.Constant(_I64, 4 * LANES)))
        return builder.load(builder.bitcast(_at(builder, vec, at), vector_type.as_pointer()), align=4)

    def lane_ints(eighths, b):
        return lane_floats(eighths, b, _VI32)

    zero = ir.Constant(_VF32, [0.0] * LANES)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(_UNIT)] for _ in range(R)]
    mins = [[cgutils.alloca_once_value(builder, zero) for _ in range(_UNIT)] for _ in range(R)]

    def block(b, k):
        """Block b of every row against the tokens, into accumulator k."""
        xv = [builder.load(builder.gep(quads, [builder.add(builder.mul(b, ir.Constant(_I64, 8)), ir.Constant(_I64, j))],
                                       inbounds=True), align=4) for j in range(8)]
        xd = lane_floats(8, b)
        xsum = lane_floats(9, b) if source.has_min else None
        sums = lane_ints(10, b) if _SIGNED else None  # the quant sums: only AVX2's lanes have them
        source.prepare(b)
        totals = None if _SIGNED else _vnni_blocks(builder, source, R, b, xv)
        for r in range(R):
            total = _signed_block(builder, source, r, b, xv, sums) if _SIGNED else totals[r]
            scale = builder.fmul(source.scale(r, b), xd)
            value = builder.fmul(builder.sitofp(total, _VF32), scale)
            builder.store(builder.fadd(builder.load(accs[r][k]), value), accs[r][k])
            if source.has_min:
                taken = builder.fmul(_splat(builder, source.minus_min(r, b), _VF32), xsum)
                builder.store(builder.fadd(builder.load(mins[r][k]), taken), mins[r][k])

    whole = builder.udiv(blocks, ir.Constant(_I64, _UNIT))
    with cgutils.for_range(builder, whole) as loop:
        for k in range(_UNIT):
            block(builder.add(builder.mul(loop.index, ir.Constant(_I64, _UNIT)), ir.Constant(_I64, k)), k)
    done = builder.mul(whole, ir.Constant(_I64, _UNIT))
    with cgutils.for_range(builder, builder.sub(blocks, done)) as loop:
        block(builder.add(done, loop.index), 0)

    def hsum(four):  # int8_dots._hsum's order, lane by lane
        a = [builder.load(p) for p in four]
        return builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))

    t0 = builder.mul(v, ir.Constant(_I64, TOKENS))
    count = builder.sub(n, t0)
    count = builder.select(builder.icmp_signed(">", count, ir.Constant(_I64, TOKENS)), ir.Constant(_I64, TOKENS), count)
    out_base = builder.bitcast(out.data, _I8.as_pointer())
    out_stride = builder.extract_value(out.strides, 0)
    results = [builder.fsub(hsum(accs[r]), hsum(mins[r])) for r in range(R)]

    def at(t, r):  # &out[t0 + t, r0 + r step]
        column = builder.add(r0, builder.mul(step, ir.Constant(_I64, r)))
        return _at(builder, out_base, builder.add(builder.mul(builder.add(t0, t), out_stride),
                                                  builder.mul(column, ir.Constant(_I64, 4))))

    full = builder.icmp_signed("==", count, ir.Constant(_I64, TOKENS))
    adjacent = builder.icmp_signed("==", step, ir.Constant(_I64, 1))
    with builder.if_else(full) as (whole, part):
        with whole:
            with builder.if_else(builder.and_(adjacent, ir.Constant(ir.IntType(1), R == _TILE_ROWS))) as (together,
                                                                                                          apart):
                with together:  # the 4 rows' results of each token together: 8 stores of 16 bytes
                    for t in range(TOKENS):
                        four = _splat(builder, builder.extract_element(results[0], ir.Constant(_I32, t)),
                                      ir.VectorType(_F32, 4))
                        for r in range(1, R):
                            four = builder.insert_element(four, builder.extract_element(results[r], ir.Constant(_I32, t)),
                                                          ir.Constant(_I32, r))
                        builder.store(four, builder.bitcast(at(ir.Constant(_I64, t), 0), four.type.as_pointer()), align=4)
                with apart:  # quarters' rows (or one row): each result on its own
                    for r in range(R):
                        for t in range(TOKENS):
                            builder.store(builder.extract_element(results[r], ir.Constant(_I32, t)),
                                          builder.bitcast(at(ir.Constant(_I64, t), r), _F32.as_pointer()))
        with part:
            for r in range(R):
                with cgutils.for_range(builder, count) as loop:
                    builder.store(builder.extract_element(results[r], loop.index),
                                  builder.bitcast(at(loop.index, r), _F32.as_pointer()))


def _vnni_blocks(builder, source, R, b, xv):
    """[<8 x i32>] * R: with VNNI (or portably), block b's exact integer dots of rows 0..R-1 with the
    8 tokens: each weight quad broadcast to every lane (folded into vpdpbusd as its signed operand,
    from memory) against the tokens' quad j plus 128 (xv[j], the unsigned operand), in two chains a
    row, then the block's -128 x the quants' sum (source.correction, broadcast), which takes off what
    the + 128 added: after the chains, not as a chain's start, so that they do not wait on the sums
    (the same integers). Quad j of every row before quad j + 1 of any: the rows' chains are
    independent, and written row after row they held the vpdpbusd in the scheduler behind each other."""
    zero = ir.Constant(_VI32, [0] * LANES)
    sums = [[zero] * _CHAINS for _ in range(R)]
    for j in range(8):
        x = builder.bitcast(xv[j], _VI8)
        for r in range(R):
            quad = builder.bitcast(_splat(builder, source.word(r, b, j), _VI32), _VI8)
            sums[r][j % _CHAINS] = int8_dots._u8_s8_quads(builder, x, quad, sums[r][j % _CHAINS])
    return [builder.add(_tree_add(builder, chains), _splat(builder, source.correction(r), _VI32))
            for r, chains in enumerate(sums)]


def _signed_block(builder, source, r, b, xv, sums):
    """<8 x i32>: with AVX2, block b's exact integer dots of row r with the 8 tokens: each weight
    quad broadcast against the tokens' quad (llama.cpp's signed pairs), or for unsigned weights
    without the signs moved, the offset's share (offset x the tokens' quant sums) taken off after."""
    words = [source.word(r, b, j) for j in range(8)]
    xb = [builder.bitcast(x, _VI8) for x in xv]
    if source.offset != SIGNED:  # unsigned weights (<= 31): no signs to move
        total = _unsigned_block(builder, words, xb)
    else:
        chains = [ir.Constant(_VI32, [0] * LANES)] * _CHAINS
        for j, word in enumerate(words):
            chains[j % _CHAINS] = builder.add(chains[j % _CHAINS], signed_pairs(builder, xb[j], word))
        total = _tree_add(builder, chains)
    if source.offset > 0:  # (u - k) . x = u . x - k x the quants' sum
        total = builder.sub(total, builder.mul(sums, ir.Constant(_VI32, [source.offset] * LANES)))
    return total


def _tree_add(builder, chains):
    total = chains[0]
    for more in chains[1:]:
        total = builder.add(total, more)
    return total


# AVX2's unsigned quants (<= 31) against signed activations (|q| <= 127): vpmaddubsw's int16 pair sums
# add up over a block's quads, a chain's share of them, before one vpmaddwd widens each chain; exact
# while a chain's int16 sum stays below 2^15
_V16I16 = ir.VectorType(ir.IntType(16), 16)
assert 8 // _CHAINS * 2 * 31 * 127 <= 32767


def _unsigned_block(builder, words, xb):
    """<LANES x i32>: per token lane, the exact dot of a block's unsigned weight quants (8 quads, words:
    i32 each) with its activations (xb: 8 vectors of 4 signed quants a lane), with AVX2: 8 vpmaddubsw,
    6 int16 adds and 2 vpmaddwd, where a vpmaddwd per quad made it 8 and 8."""
    chains = [None] * _CHAINS
    for j, word in enumerate(words):
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, builder.bitcast(_splat(builder, word, _VI32), _VI8),
                      xb[j])
        c = j % _CHAINS
        chains[c] = pairs if chains[c] is None else builder.add(chains[c], pairs)
    return _tree_add(builder, [_call(builder, "llvm.x86.avx2.pmadd.wd", _VI32, chain, ir.Constant(_V16I16, [1] * 16))
                               for chain in chains])


def _is_lanes(lanes, out, *ints):
    return (lanes == types.Array(types.uint8, 2, "C") and out == types.Array(types.float32, 2, "C")
            and all(isinstance(a, types.Integer) for a in ints))


def _in_place_tile(R):
    """An intrinsic (u8, r, step, lanes, v, n, out) -> 0: Q8_0 rows r, r + step, .. r + (R - 1) step of
    u8 [rows, row_bytes] times the tokens of vector v of `lanes`, into out[t, r + i step] for t < n."""

    def codegen(context, builder, sig, args):
        lanes, out = (context.make_array(sig.args[k])(context, builder, args[k]) for k in (3, 6))
        _emit_tile(builder, _InPlace(builder, context, sig, args, R), R, lanes, _i64(builder, args[4]),
                   _i64(builder, args[5]), out, _i64(builder, args[1]), _i64(builder, args[2]))
        return context.get_constant(types.int64, 0)

    def typer(typingctx, u8, r, step, lanes, v, n, out):
        if not (isinstance(u8, types.Array) and u8.ndim == 2 and u8.dtype == types.uint8 and u8.layout == "C"
                and _is_lanes(lanes, out, r, step, v, n)):
            return None
        return types.int64(u8, r, step, lanes, v, n, out), codegen

    typer.__name__ = f"decode_lanes_q8_0_{R}"
    return intrinsic(typer)


def _unpacked_tile(R, has_min, offset=SIGNED):
    """An intrinsic (ws, wa, wm, i, lanes, v, n, out, r0) -> 0: rows i..i+R-1 of unpacked weights
    (_unpack_row's; with AVX2, of a type stored with `offset`, or signed) times the tokens of vector v
    of `lanes`, into out[t, r0 + k] for t < n."""

    def codegen(context, builder, sig, args):
        lanes, out = (context.make_array(sig.args[k])(context, builder, args[k]) for k in (4, 7))
        _emit_tile(builder, _Unpacked(builder, context, sig, args, R, has_min, offset), R, lanes,
                   _i64(builder, args[5]), _i64(builder, args[6]), out, _i64(builder, args[8]), ir.Constant(_I64, 1))
        return context.get_constant(types.int64, 0)

    def typer(typingctx, ws, wa, wm, i, lanes, v, n, out, r0):
        if not (ws == types.Array(types.int8, 2, "C") and wa == wm == types.Array(types.float32, 2, "C")
                and _is_lanes(lanes, out, i, v, n, r0)):
            return None
        return types.int64(ws, wa, wm, i, lanes, v, n, out, r0), codegen

    typer.__name__ = f"decode_lanes_{R}{'_min' if has_min else ''}{offset if offset > 0 else ''}"
    return intrinsic(typer)


_Q8_0_TILE, _Q8_0_TILE_1 = _in_place_tile(_TILE_ROWS), _in_place_tile(1)
_TILE, _TILE_1 = _unpacked_tile(_TILE_ROWS, False), _unpacked_tile(1, False)
_TILE_MIN, _TILE_MIN_1 = _unpacked_tile(_TILE_ROWS_MIN, True, UNSIGNED), _unpacked_tile(1, True, UNSIGNED)
# with AVX2 the types stored with an offset (Q4_0 8, Q5_0 16: int8_dots' quant readers) keep their
# unsigned quants, multiplied with no sign moved (_unsigned_block: about 2 instructions a quad, not 5),
# the offset's share taken off each block's sum; elsewhere they are signed like IQ4_NL's
if _SIGNED:
    _TILE_Q4_0, _TILE_Q4_0_1 = _unpacked_tile(_TILE_ROWS, False, 8), _unpacked_tile(1, False, 8)
    _TILE_Q5_0, _TILE_Q5_0_1 = _unpacked_tile(_TILE_ROWS, False, 16), _unpacked_tile(1, False, 16)
else:
    _TILE_Q4_0, _TILE_Q4_0_1 = _TILE_Q5_0, _TILE_Q5_0_1 = _TILE, _TILE_1


@njit(cache=True, nogil=True)
def rows(tt, u8, first, end, lanes, out):
    """out[t, r] = row r . x_hat[t] for rows first..end-1 of u8 (type code tt, one of LANE_TYPES) and
    the decode tokens in `lanes` (room, filled by put_token): what int8_dots' tiles give, bit for bit.
    A tile's rows meet every vector of tokens while they are in L1; a Q8_0 tile's 4 rows are the
    group's quarters (_PREFETCH_ROWS)."""
    n = out.shape[0]
    vectors = lanes.shape[0]
    if tt == _Q8_0:
        quarter = (end - first) // _TILE_ROWS
        for k in range(quarter):
            for v in range(vectors):
                _Q8_0_TILE(u8, first + k, quarter, lanes, v, n, out)
        for r in range(first + _TILE_ROWS * quarter, end):
            for v in range(vectors):
                _Q8_0_TILE_1(u8, r, 1, lanes, v, n, out)
        return
    cols = lanes.shape[1] // _LANE_BYTES
    has_min = tt == _Q4_1 or tt == _Q5_1
    R = _TILE_ROWS_MIN if has_min else _TILE_ROWS
    ws = np.empty((R, cols), np.int8)
    wa = np.empty((R, cols // _BLOCK), np.float32)
    wm = np.empty((R, cols // _BLOCK), np.float32)
    r = first
    while r < end:
        count = min(R, end - r)
        for i in range(count):
            _unpack_row(tt, u8, r + i, ws[i], wa[i], wm[i])
        for v in range(vectors):
            if count == R and has_min:
                _TILE_MIN(ws, wa, wm, 0, lanes, v, n, out, r)
            elif count == R and tt == _Q4_0:
                _TILE_Q4_0(ws, wa, wm, 0, lanes, v, n, out, r)
            elif count == R and tt == _Q5_0:
                _TILE_Q5_0(ws, wa, wm, 0, lanes, v, n, out, r)
            elif count == R:
                _TILE(ws, wa, wm, 0, lanes, v, n, out, r)
            else:
                for i in range(count):
                    if has_min:
                        _TILE_MIN_1(ws, wa, wm, i, lanes, v, n, out, r + i)
                    elif tt == _Q4_0:
                        _TILE_Q4_0_1(ws, wa, wm, i, lanes, v, n, out, r + i)
                    elif tt == _Q5_0:
                        _TILE_Q5_0_1(ws, wa, wm, i, lanes, v, n, out, r + i)
                    else:
                        _TILE_1(ws, wa, wm, i, lanes, v, n, out, r + i)
        r += count
