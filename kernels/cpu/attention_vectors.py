"""The vector code of CPU attention: a block's scores and its weighted values, as LLVM IR.

paged_attention.py keeps each KV head's rows of a block together, K transposed ([head_dim,
block_size]: each dimension's values for the block's keys side by side) and V as rows.
- `block_scores(kind)`: up to MAX_HEADS query heads against KEYS keys of a block. A dimension is one
  KEYS-wide multiply-add per head (the query's value broadcast), so there is no horizontal sum per
  key, and each key vector is loaded and widened once for all the heads of the group (GQA).
- `block_values(kind)`: a block's value rows times their weights into up to MAX_HEADS heads'
  accumulators, VALUES dimensions at a time held in registers across the rows, each row widened
  once for all the heads.
- `row_sum`: the softmax weights' total; `prefetch_block`: a hint for a block's rows of one KV head.
`kind` is the stored dtype: f32, f16, bf16 (uint16 bits), q8_0 (int8 values and one f16 scale per 32
dimensions of each key or row: a key's sums are scaled 32 dimensions at a time, a row's values as
they are widened). Intrinsics, because numba has no vector types and LLVM vectorizes a loop over
dimensions, not over keys or heads. Each call's floating-point order is fixed by this code (not by a
vectorizer; see _add), so every caller of the kernel gets the same bits, and a key's score, a row's
weight and their sums do not depend on where the block boundaries fall: engines with different
block sizes agree bit for bit. What it bought: paged_attention.py's docstring.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ember.kernels.convert import QK8_0
from ember.kernels.cpu import int8_dots
from ember.kernels.cpu.int8_dots import _at, _call, _i64

KEYS = 16  # keys a call scores: one vector of 16 floats (a zmm, or two ymm)
MAX_HEADS = 4  # query heads a call scores at once (a group's larger heads take several calls)
# the dimension loop is split into this many independent chains per head count, so that at least
# eight vector accumulators are in flight (a multiply-add's latency is 4 cycles, two issue a cycle)
_PHASES = {1: 4, 2: 2, 3: 2, 4: 1}

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
_VF = ir.VectorType(_F32, KEYS)
# each kind's stored element: its numba type and bytes
_STORED = {"f32": (types.float32, 4), "f16": (types.uint16, 2), "bf16": (types.uint16, 2), "q8_0": (types.int8, 1)}


def _splat(builder, f):
    return int8_dots._splat(builder, f, KEYS)


def _load(builder, at, element, align, mask):
    """KEYS values of type `element` at `at` (an i8*); with a mask (<KEYS x i1>), only its lanes are
    read (the others 0): a block of fewer keys ends before a vector's end."""
    vt = ir.VectorType(element, KEYS)
    ptr = builder.bitcast(at, vt.as_pointer())
    if mask is None:
        return builder.load(ptr, align=align)
    name = {_F32: "v16f32", _I16: "v16i16", ir.IntType(8): "v16i8"}[element]
    return _call(builder, f"llvm.masked.load.{name}.p0{name}", vt, ptr, ir.Constant(_I32, align), mask,
                 ir.Constant(vt, [0] * KEYS if element != _F32 else [0.0] * KEYS))


def _first_lanes(builder, count):
    """The mask of lanes 0 .. count - 1."""
    lanes = ir.Constant(ir.VectorType(count.type, KEYS), list(range(KEYS)))
    wide = builder.insert_element(ir.Constant(ir.VectorType(count.type, KEYS), None), count, ir.Constant(_I32, 0))
    return builder.icmp_unsigned("<", lanes, int8_dots._pick(builder, wide, [0] * KEYS))


def _widen(builder, kind, at, mask=None):
    """The KEYS stored values at `at` (an i8*) as floats, exactly (masked: _load)."""
    if kind == "f32":
        return _load(builder, at, _F32, 4, mask)
    if kind == "q8_0":
        return builder.sitofp(_load(builder, at, ir.IntType(8), 1, mask), _VF)
    raw = _load(builder, at, _I16, 2, mask)
    if kind == "f16":
        return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), KEYS)), _VF)
    wide = builder.shl(builder.zext(raw, ir.VectorType(_I32, KEYS)), ir.Constant(ir.VectorType(_I32, KEYS), [16] * KEYS))
    return builder.bitcast(wide, _VF)


def _fma(builder, a, b, c):
    return _call(builder, "llvm.fmuladd.v16f32", _VF, a, b, c)


# The callers are compiled with fast-math, under which LLVM may reorder a chain of fadds (and did:
# a block's weights were summed in another order for each block size, and a token's output moved
# with the engine's block size). A vector multiply-add (numba puts its flags on scalar float
# operations and calls, not on calls of vector intrinsics) by a 1 that LLVM cannot see (an empty
# inline asm hands it over) is the same exact sum, in an order no pass changes.
def _one(builder):
    """1.0, opaque to the optimizer."""
    bits = builder.asm(ir.FunctionType(_I32, [_I32]), "", "=r,0", [ir.Constant(_I32, 0x3F800000)], False)
    return builder.bitcast(bits, _F32)


def _add(builder, one, a, b):
    """a + b, in this order for good (one: _one's), for KEYS-wide vectors or floats (in lane 0)."""
    if a.type != _F32:
        return _fma(builder, a, _splat(builder, one), b)
    wide = _fma(builder, _splat(builder, a), _splat(builder, one), _splat(builder, b))
    return builder.extract_element(wide, ir.Constant(_I32, 0))


def _by_heads(builder, heads, emit):
    """A switch on the runtime head count (1 .. MAX_HEADS) into emit(h)'s code for each count h."""
    done = builder.append_basic_block("heads_done")
    switch = builder.switch(heads, done)
    for h in range(1, MAX_HEADS + 1):
        case = builder.append_basic_block(f"heads_{h}")
        switch.add_case(ir.Constant(heads.type, h), case)
        builder.position_at_end(case)
        emit(h)
        builder.branch(done)
    builder.position_at_end(done)


def _dots(builder, kind, keys_at, key_stride, q_at, q_stride, heads, start, stop, mask, one):
    """Per head h: sum over d in [start, stop) of q[h, d] * key[d] (KEYS-wide), in _PHASES[heads]
    chains (d by d in each chain) added at the end in chain order: each lane's order depends only on
    head_dim and the number of heads, not on where its key sits."""
    phases = _PHASES[heads]
    zero = ir.Constant(_VF, [0.0] * KEYS)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(phases)] for _ in range(heads)]
    span = builder.sub(stop, start)
    whole = builder.udiv(span, ir.Constant(span.type, phases))

    def step(d, phase):
        key = _widen(builder, kind, _at(builder, keys_at, builder.mul(d, key_stride)), mask)
        for h in range(heads):
            q_ptr = _at(builder, q_at, builder.add(builder.mul(ir.Constant(d.type, h), q_stride), builder.mul(d, ir.Constant(d.type, 4))))
            x = builder.load(builder.bitcast(q_ptr, _F32.as_pointer()), align=4)
            a = accs[h][phase]
            builder.store(_fma(builder, _splat(builder, x), key, builder.load(a)), a)

    with cgutils.for_range(builder, whole) as loop:
        base = builder.add(start, builder.mul(loop.index, ir.Constant(span.type, phases)))
        for p in range(phases):
            step(builder.add(base, ir.Constant(span.type, p)), p)
    tail = builder.add(start, builder.mul(whole, ir.Constant(span.type, phases)))
    with cgutils.for_range(builder, builder.sub(stop, tail)) as loop:
        step(builder.add(tail, loop.index), 0)
    sums = []
    for row in accs:
        total = builder.load(row[0])
        for a in row[1:]:
            total = _add(builder, one, builder.load(a), total)
        sums.append(total)
    return sums


def block_scores(kind: str):  # type: ignore[no-untyped-def]
    """An intrinsic (keys, scales, blk, kv, c0, count, q, i, h0, heads, scale, out, g0, col) -> 0 for a
    store of `kind`: out[g0 + h, col:col + KEYS] = scale * (q[i, h0 + h] . the keys c0 .. c0 + count - 1
    of block blk, KV head kv; 0 for the lanes past count), for h < heads (1 .. MAX_HEADS) and count
    1 .. KEYS (a block of fewer keys, or its last ones, read through masked loads: every key's score
    has the same bits whatever the block size). out must hold KEYS columns from col on.
    keys [n_blocks, kv_heads, head_dim, block_size]
    (float32; uint16 f16 or bf16 bits; int8 for q8_0), scales [n_blocks, kv_heads, head_dim / 32,
    block_size] f16 bits (q8_0 only: each 32 dimensions' sum times its key's scale, added in order)."""
    stored, item = _STORED[kind]

    def typer(typingctx, keys, scales, blk, kv, c0, count, q, i, h0, heads, scale, out, g0, col):  # type: ignore[no-untyped-def]
        if not (keys == types.Array(stored, 4, "C") and scales == types.Array(types.uint16, 4, "C")
                and q == types.Array(types.float32, 3, "C") and out == types.Array(types.float32, 2, "C")):
            return None

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            k_arr, s_arr, q_arr, o_arr = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 1, 6, 11))
            blk_, kv_, c0_, count_, i_, h0_, heads_, g0_, col_ = (_i64(builder, args[j]) for j in (2, 3, 4, 5, 7, 8, 9, 12, 13))
            scale_ = args[10]
            ks = [builder.extract_value(k_arr.strides, j) for j in range(3)]
            keys_at = _at(builder, builder.bitcast(k_arr.data, ir.IntType(8).as_pointer()),
                          builder.add(builder.add(builder.mul(blk_, ks[0]), builder.mul(kv_, ks[1])),
                                      builder.mul(c0_, ir.Constant(blk_.type, item))))
            qs = [builder.extract_value(q_arr.strides, j) for j in range(2)]
            q_at = _at(builder, builder.bitcast(q_arr.data, ir.IntType(8).as_pointer()),
                       builder.add(builder.mul(i_, qs[0]), builder.mul(h0_, qs[1])))
            os0 = builder.extract_value(o_arr.strides, 0)
            out_at = _at(builder, builder.bitcast(o_arr.data, ir.IntType(8).as_pointer()),
                         builder.add(builder.mul(g0_, os0), builder.mul(col_, ir.Constant(col_.type, 4))))
            hd = builder.extract_value(q_arr.shape, 2)
            partial, one = _first_lanes(builder, count_), _one(builder)

            def scores(heads):
                with builder.if_else(builder.icmp_unsigned("==", count_, ir.Constant(count_.type, KEYS))) as (full, part):
                    for mask, branch in ((None, full), (partial, part)):
                        with branch:
                            if kind != "q8_0":
                                sums = _dots(builder, kind, keys_at, ks[2], q_at, qs[1], heads, ir.Constant(hd.type, 0),
                                             hd, mask, one)
                            else:
                                sums = _scaled_dots(builder, s_arr, blk_, kv_, c0_, keys_at, ks[2], q_at, qs[1], heads, hd,
                                                    mask, one)
                            for h, total in enumerate(sums):
                                at = _at(builder, out_at, builder.mul(ir.Constant(os0.type, h), os0))
                                builder.store(builder.fmul(total, _splat(builder, scale_)),
                                              builder.bitcast(at, _VF.as_pointer()), align=4)

            _by_heads(builder, heads_, scores)
            return context.get_constant(types.int64, 0)

        return types.int64(keys, scales, blk, kv, c0, count, q, i, h0, heads, scale, out, g0, col), codegen

    typer.__name__ = f"_block_scores_{kind}"
    return intrinsic(typer)


def _scaled_dots(builder, s_arr, blk, kv, c0, keys_at, key_stride, q_at, q_stride, heads, hd, mask, one):
    """q8_0: per 32 dimensions, the dots of their int8 values times those keys' f16 scales, added
    group by group."""
    ss = [builder.extract_value(s_arr.strides, j) for j in range(3)]
    scales_at = _at(builder, builder.bitcast(s_arr.data, ir.IntType(8).as_pointer()),
                    builder.add(builder.add(builder.mul(blk, ss[0]), builder.mul(kv, ss[1])),
                                builder.mul(c0, ir.Constant(blk.type, 2))))
    totals = [cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * KEYS)) for _ in range(heads)]
    groups = builder.udiv(hd, ir.Constant(hd.type, QK8_0))
    with cgutils.for_range(builder, groups) as loop:
        start = builder.mul(loop.index, ir.Constant(hd.type, QK8_0))
        sums = _dots(builder, "q8_0", keys_at, key_stride, q_at, q_stride, heads, start,
                     builder.add(start, ir.Constant(hd.type, QK8_0)), mask, one)
        scale = _widen(builder, "f16", _at(builder, scales_at, builder.mul(loop.index, ss[2])), mask)
        for t, s in zip(totals, sums):
            builder.store(_fma(builder, s, scale, builder.load(t)), t)
    return [builder.load(t) for t in totals]


VALUES = 16  # dimensions a value vector holds: head_dim must be a multiple (else paged_attention adds
# four rows at a time in compiled loops)
# value vectors a pass holds per head, for at least eight accumulators in flight (each dimension's
# sum still goes row by row: the same bits whatever the span or the block size)
_SPANS = {1: 4, 2: 2, 3: 1, 4: 1}


def block_values(kind: str):  # type: ignore[no-untyped-def]
    """An intrinsic (values, scales, blk, kv, o0, o1, weights, col, g0, heads, acc) -> 0 for a store of
    `kind`: for h < heads (1 .. MAX_HEADS), acc[g0 + h] += the sum over rows o in [o0, o1) of
    weights[g0 + h, col + o] times row o of block blk, KV head kv, row by row. values [n_blocks,
    kv_heads, block_size, head_dim] (head_dim a multiple of VALUES), scales [n_blocks, kv_heads, block_size, head_dim / 32] f16 bits (q8_0: each value times
    its row's scale for its 32 dimensions). Each VALUES dimensions of every head's accumulator stay
    in registers across the block's rows, and each row's values are loaded and widened once for all
    the heads (the four-rows-at-a-time loop widened them again for each head)."""
    stored, item = _STORED[kind]

    def typer(typingctx, values, scales, blk, kv, o0, o1, weights, col, g0, heads, acc):  # type: ignore[no-untyped-def]
        if not (values == types.Array(stored, 4, "C") and scales == types.Array(types.uint16, 4, "C")
                and weights == acc == types.Array(types.float32, 2, "C")):
            return None

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            v_arr, s_arr, w_arr, a_arr = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 1, 6, 10))
            blk_, kv_, o0_, o1_, col_, g0_, heads_ = (_i64(builder, args[j]) for j in (2, 3, 4, 5, 7, 8, 9))
            i8p = ir.IntType(8).as_pointer()
            vs = [builder.extract_value(v_arr.strides, j) for j in range(3)]
            rows_at = _at(builder, builder.bitcast(v_arr.data, i8p),
                          builder.add(builder.mul(blk_, vs[0]), builder.mul(kv_, vs[1])))
            ss = [builder.extract_value(s_arr.strides, j) for j in range(3)]
            scales_at = _at(builder, builder.bitcast(s_arr.data, i8p),
                            builder.add(builder.mul(blk_, ss[0]), builder.mul(kv_, ss[1])))
            ws0 = builder.extract_value(w_arr.strides, 0)
            w_at = _at(builder, builder.bitcast(w_arr.data, i8p),
                       builder.add(builder.mul(g0_, ws0), builder.mul(col_, ir.Constant(col_.type, 4))))
            as0 = builder.extract_value(a_arr.strides, 0)
            acc_at = _at(builder, builder.bitcast(a_arr.data, i8p), builder.mul(g0_, as0))
            hd = builder.extract_value(a_arr.shape, 1)
            frame = _Frame(builder, kind, item, rows_at, vs[2], scales_at, ss[2], w_at, ws0, acc_at, as0)

            def values(heads):
                chunks = builder.udiv(hd, ir.Constant(hd.type, VALUES))
                span = _SPANS[heads]
                whole = builder.udiv(chunks, ir.Constant(hd.type, span))
                with cgutils.for_range(builder, whole) as loop:
                    frame.chunks(heads, builder.mul(loop.index, ir.Constant(hd.type, span)), span, o0_, o1_)
                with cgutils.for_range(builder, builder.sub(chunks, builder.mul(whole, ir.Constant(hd.type, span)))) as loop:
                    frame.chunks(heads, builder.add(builder.mul(whole, ir.Constant(hd.type, span)), loop.index), 1, o0_, o1_)

            _by_heads(builder, heads_, values)
            return context.get_constant(types.int64, 0)

        return types.int64(values, scales, blk, kv, o0, o1, weights, col, g0, heads, acc), codegen

    typer.__name__ = f"_block_values_{kind}"
    return intrinsic(typer)


class _Frame:
    """block_values' addresses, and the code of its two loops."""

    def __init__(self, builder, kind, item, rows_at, row_stride, scales_at, scale_stride, w_at, w_stride, acc_at,
                 acc_stride):
        self.builder, self.kind, self.item = builder, kind, item
        self.rows_at, self.row_stride, self.scales_at, self.scale_stride = rows_at, row_stride, scales_at, scale_stride
        self.w_at, self.w_stride, self.acc_at, self.acc_stride = w_at, w_stride, acc_at, acc_stride

    def _ptr(self, base, offset, ty):
        return self.builder.bitcast(_at(self.builder, base, offset), ty.as_pointer())

    def weight(self, h, o):
        b = self.builder
        at = b.add(b.mul(ir.Constant(o.type, h), self.w_stride), b.mul(o, ir.Constant(o.type, 4)))
        return b.load(self._ptr(self.w_at, at, _F32), align=4)

    def chunks(self, heads, c, span, o0, o1):
        """Dimensions c * VALUES .. (c + span) * VALUES - 1 of every head's accumulator, over the rows
        o0 .. o1 - 1 in order."""
        b = self.builder
        firsts = [b.mul(b.add(c, ir.Constant(c.type, k)), ir.Constant(c.type, VALUES)) for k in range(span)]
        acc_ptrs = [[self._ptr(self.acc_at, b.add(b.mul(ir.Constant(c.type, h), self.acc_stride),
                                                  b.mul(first, ir.Constant(c.type, 4))), _VF) for first in firsts]
                    for h in range(heads)]
        chains = [[cgutils.alloca_once(b, _VF) for _ in range(span)] for _ in range(heads)]
        for h in range(heads):
            for k in range(span):
                b.store(b.load(acc_ptrs[h][k], align=4), chains[h][k])
        with cgutils.for_range(b, b.sub(o1, o0)) as loop:
            o = b.add(o0, loop.index)
            weights = [_splat(b, self.weight(h, o)) for h in range(heads)]
            for k, first in enumerate(firsts):
                at = b.add(b.mul(o, self.row_stride), b.mul(first, ir.Constant(o.type, self.item)))
                v = _widen(b, self.kind, _at(b, self.rows_at, at))
                if self.kind == "q8_0":
                    group = b.udiv(first, ir.Constant(c.type, QK8_0))
                    s_at = b.add(b.mul(o, self.scale_stride), b.mul(group, ir.Constant(o.type, 2)))
                    bits = b.load(self._ptr(self.scales_at, s_at, _I16), align=2)
                    v = b.fmul(v, _splat(b, b.fpext(b.bitcast(bits, ir.HalfType()), _F32)))
                for h in range(heads):
                    chain = chains[h][k]
                    b.store(_fma(b, weights[h], v, b.load(chain)), chain)
        for h in range(heads):
            for k in range(span):
                b.store(b.load(chains[h][k]), acc_ptrs[h][k], align=4)


@intrinsic
def prefetch_block(typingctx, store, blk, kv):  # type: ignore[no-untyped-def]
    """A hint: the rows of KV head kv in block blk of store [n_blocks, kv_heads, ...] into the cache,
    one prefetch per 64-byte line."""
    if not (isinstance(store, types.Array) and store.ndim == 4 and store.layout == "C"):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        blk_, kv_ = _i64(builder, args[1]), _i64(builder, args[2])
        start = builder.add(builder.mul(blk_, builder.extract_value(arr.strides, 0)),
                            builder.mul(kv_, builder.extract_value(arr.strides, 1)))
        at = _at(builder, builder.bitcast(arr.data, ir.IntType(8).as_pointer()), start)
        lines = builder.udiv(builder.extract_value(arr.strides, 1), ir.Constant(start.type, 64))
        with cgutils.for_range(builder, lines) as loop:
            line = _at(builder, at, builder.mul(loop.index, ir.Constant(start.type, 64)))
            _call(builder, "llvm.prefetch.p0i8", ir.VoidType(), line, ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                  ir.Constant(_I32, 1))
        return context.get_constant(types.int64, 0)

    return types.int64(store, blk, kv), codegen


@intrinsic
def row_sum(typingctx, rows, g, start, count):  # type: ignore[no-untyped-def]
    """rows[g, start:start + count] summed (float32 [n, width], KEYS columns of room past the end): lane j
    of a KEYS-wide vector takes the values start + j, start + KEYS + j, ... in turn, the lanes are then
    added in halves, all in an order fixed by this code (the softmax weights' total: the same bits
    wherever the first weight sits, whatever the caller's vectorizer would make of a summing loop)."""
    if not (rows == types.Array(types.float32, 2, "C") and isinstance(g, types.Integer)
            and isinstance(start, types.Integer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        g_, start_, count_ = (_i64(builder, a) for a in args[1:])
        at = _at(builder, builder.bitcast(arr.data, ir.IntType(8).as_pointer()),
                 builder.add(builder.mul(g_, builder.extract_value(arr.strides, 0)), builder.mul(start_, ir.Constant(start_.type, 4))))
        one = _one(builder)
        total = cgutils.alloca_once_value(builder, ir.Constant(_VF, [0.0] * KEYS))
        whole = builder.udiv(count_, ir.Constant(count_.type, KEYS))
        with cgutils.for_range(builder, whole) as loop:
            v = _load(builder, _at(builder, at, builder.mul(loop.index, ir.Constant(count_.type, 4 * KEYS))), _F32, 4, None)
            builder.store(_add(builder, one, v, builder.load(total)), total)
        rest = builder.sub(count_, builder.mul(whole, ir.Constant(count_.type, KEYS)))
        with builder.if_then(builder.icmp_unsigned(">", rest, ir.Constant(rest.type, 0))):
            tail = _at(builder, at, builder.mul(whole, ir.Constant(count_.type, 4 * KEYS)))
            v = _load(builder, tail, _F32, 4, _first_lanes(builder, rest))
            builder.store(_add(builder, one, v, builder.load(total)), total)
        v, width = builder.load(total), KEYS
        while width > 1:
            width //= 2
            high = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, KEYS), [width + j if j < width else j for j in range(KEYS)]))
            v = _add(builder, one, high, v)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(rows, g, start, count), codegen
