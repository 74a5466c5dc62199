"""CPU kernels that multiply by weights still in their file format (F32, F16, BF16 and every block type).

This module owns the CPU backend's weight layout (CpuWeight, made by pack) and its kernels: matmul
with few tokens (decode, batched or not: quantized weights meet int8-quantized activations in
integer arithmetic, kernels/cpu/int8_dots.py, each weight row read once for all tokens; F16/BF16
rows widen in registers), matmul with many tokens (prompts: dequantizes each row once into a small
buffer, then a register-tiled float32 product with all n tokens), and embedding (dequantizes the
selected rows). The block layouts are documented, and checked, in kernels/reference/quant.py; the
kernels are tested against it.

Why the kernels look the way they do (each point measured on the 2-core Zen 4 VM this was built on):
- Decode with quantized weights quantizes x to ggml's q8_0 once per call and multiplies bytes
  (int8_dots): 1.5-2.2x faster than widening every weight to float32 on K-quants, where the float
  kernels were bound by bit unpacking, not memory; level on Q8_0, which streams at memory speed
  either way. It is llama.cpp's numerics: the product is with x_hat, x after the q8_0 round trip.
- From decode_lanes.MIN_TOKENS decode rows on, weights of the 32-value types meet them in token lanes
  (decode_lanes.py: one row's 8 tokens a 256-bit vector, each weight quad broadcast into vpdpbusd
  from memory with AVX-512 VNNI, in llama.cpp's signed pairs with AVX2; no horizontal sums), bit for
  bit the tiles' results: the activations' room holds the tokens in lanes too, filled as each token
  is quantized; a short last vector's tokens stay with the tiles.
- The F16/BF16 row dot is one reduction that LLVM vectorizes into register accumulators; numba
  rewrites every a[k] as a[k + n if k < 0 else k], and where LLVM cannot prove k >= 0 that select
  turns consecutive loads into gathers (10x slower), so hot loads use ld/ld1, which skip it.
- numba has no float16; the f16 intrinsic bitcasts the raw bits to LLVM `half` and widens them,
  which becomes F16C vcvtph2ps: f16 scales cost one instruction and F16 weights vectorize, with no
  lookup table (a gather per block).
- numba widens small-int arithmetic to int64, which LLVM vectorizes in 64-bit lanes; quant bit fields
  are therefore extracted by an intrinsic (quant) in 32-bit IR, and Q4_K/Q5_K 6-bit scales are
  unpacked by another (k4_header) with ggml's 32-bit mask trick, as one vector.
- The n-token kernel dequantizes 16 rows at a time (each block once per call) into an L2-resident
  float32 buffer, then multiplies it with register tiles of 4 tokens by 4 rows (AVX-512) or 2 rows
  (AVX2: 16 vector registers; 4-row tiles spilled there). It runs in float32 (activations never
  quantized), so its results match the float64 reference to float32 rounding.
- All kernels release the GIL (nogil) so the daemon's event loop keeps running beside them, and
  parallelize over output rows with prange.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import llvmlite.binding as llvm
from numba import njit, prange

from ember.kernels.cpu import dense
from ember.kernels.cpu.twin import Twin
from ember.kernels.cpu import decode_lanes, int8_dots, int8_prompt
from ember.kernels.cpu.quant_bits import (EXACT as _EXACT, bf16, f16, fifth_bits, k4_header, ld, ld1,
                                          q3_k_scale, quant, quant3)
from ember.kernels.cpu.int8_dots import (Q6_K_OFFSET, Q8_0_OFFSET, QK, QK_K, ROW_PAIR, TILE_SIZES, TILE_TOKENS,
                                        offsets_width, quad_offsets, quantize_activation, quantize_activation_k)
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import IQ4_LEVELS, TensorType, row_bytes

__all__ = ["CpuWeight", "pack", "decode_flags", "matmul", "matmul_many", "swiglu_matmul", "embedding"]

# Type codes as plain ints: numba folds these module globals into constants.
_F16 = int(TensorType.F16)
_BF16 = int(TensorType.BF16)
_Q8_0 = int(TensorType.Q8_0)
_Q4_K = int(TensorType.Q4_K)
_Q5_K = int(TensorType.Q5_K)
_Q6_K = int(TensorType.Q6_K)
_Q4_0, _Q4_1, _Q5_0, _Q5_1 = (int(t) for t in (TensorType.Q4_0, TensorType.Q4_1, TensorType.Q5_0, TensorType.Q5_1))
_Q2_K, _Q3_K = int(TensorType.Q2_K), int(TensorType.Q3_K)
_IQ4_NL, _IQ4_XS = int(TensorType.IQ4_NL), int(TensorType.IQ4_XS)
_IQ4_LEVELS = np.array(IQ4_LEVELS, np.float32)  # numba freezes a global array into the code

_MATVEC_ROWS = 32  # rows per parallel work item of the matvec
SERIAL_GROUP = 1 << 40  # _matmul_int8_many's group rows on one thread: every weight whole
_PARALLEL_QUANTIZE_TOKENS = 4  # fewer decode tokens than this are quantized on the calling thread
_MATMUL_ROWS = 16  # rows dequantized together by the n-token kernel: 16 x cols f32 stays in L2
_FLOAT_TILE_TOKENS = 4  # tokens per register tile of the n-token kernel (_tile_product)
# weights whose decode rows take the integer dots of int8_dots: every block type
INT8_TYPES = frozenset(t for t in TensorType if t not in (TensorType.F32, TensorType.F16, TensorType.BF16))
# the types of 32-value blocks, whose decode rows meet q8_0 activations (the others, K-quants, q8_K's);
# a table by type code, which numba freezes into the kernels
_Q8_0_ACTIVATIONS = np.zeros(max(TensorType) + 1, np.bool_)
_Q8_0_ACTIVATIONS[[TensorType.Q8_0, TensorType.Q4_0, TensorType.Q4_1, TensorType.Q5_0, TensorType.Q5_1,
                   TensorType.IQ4_NL]] = True
# 32 vector registers (AVX-512) fit 4-row tiles in the n-token kernel, 16 (AVX2) only 2-row ones;
# numba folds this into the compiled code, and its cache is kept per CPU model and features
_WIDE_TILES = bool(llvm.get_host_cpu_features().get("avx512f", False))

_JIT = dict(fastmath=True, cache=True, nogil=True)
# No fast-math at all: numba would otherwise flag every float op of the function, the inlined integer
# dots' included, and LLVM would reassociate each tile shape its own way (results then depend on n).
_STRICT = dict(cache=True, nogil=True)


@dataclass(frozen=True)
class CpuWeight:
    """A matrix [rows, cols] in its file format, as the CPU kernels read it.

    u8, i8, u16 and u32 are read-only views of the same bytes (the file's rows, never copied):
    uint8 / int8 [rows, row_bytes], uint16 [rows, row_bytes // 2] and, where row_bytes is a multiple
    of 4 (Q4_K, Q5_K), uint32 [rows, row_bytes // 4] (else empty). For F32 weights f32 is the float32
    [rows, cols] matrix (also a view) and the byte views are empty.
    """

    ttype: TensorType
    rows: int
    cols: int
    u8: np.ndarray
    i8: np.ndarray
    u16: np.ndarray
    u32: np.ndarray
    f32: np.ndarray | None = None
    # derived once (the decode path reads them on every call): the type code the kernels switch on,
    # whether decode rows take the integer kernels, the bytes one matvec reads, and where u8's bytes
    # are (expert_ffn.py hands the kernel a table of experts' addresses)
    code: int = field(init=False)
    int8: bool = field(init=False)
    nbytes: int = field(init=False)
    address: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", int(self.ttype))
        object.__setattr__(self, "int8", self.ttype in INT8_TYPES)
        object.__setattr__(self, "nbytes", self.rows * row_bytes(self.ttype, self.cols))
        object.__setattr__(self, "address", self.u8.__array_interface__["data"][0])


def pack(t: RawTensor) -> CpuWeight:
    """CpuWeight of a 2-D RawTensor, zero-copy.

    Nothing is copied when t.data is C-contiguous (the case for mmap'd GGUF/safetensors tensors): the
    kernels read the file's blocks in place through read-only uint8/int8/uint16/uint32 views of them
    (f16 scales are widened in registers, so not even the scales are repacked). A non-contiguous
    t.data is copied once, in its own format (1x the file's bytes, never widened to float32).
    """
    ttype = TensorType(t.ttype)
    rows, cols = t.rows, t.cols
    data = np.ascontiguousarray(t.rows2d())  # no-op for the contiguous views loaders produce
    if ttype == TensorType.F32:
        f32 = _read_only(np.asarray(data, np.float32))
        empty = _read_only(np.empty((rows, 0), np.uint8))
        return CpuWeight(ttype, rows, cols, empty, empty.view(np.int8), empty.view(np.uint16),
                         empty.view(np.uint32), f32)
    u8 = _read_only(np.asarray(data).view(np.uint8).reshape(rows, row_bytes(ttype, cols)))
    # Every block size (34, 144, 176, 210 bytes; 2 for f16) is even, so u16 sees each f16 field whole;
    # Q4_K/Q5_K blocks (144, 176 bytes) are whole uint32 words, so their 12 scale bytes are 3 words.
    u32 = u8.view(np.uint32) if u8.shape[1] % 4 == 0 else _read_only(np.empty((rows, 0), np.uint32))
    return CpuWeight(ttype, rows, cols, u8, u8.view(np.int8), u8.view(np.uint16), u32)


def _read_only(a: np.ndarray) -> np.ndarray:
    """A plain-ndarray, read-only view: one numba signature for mmap'd and in-memory weights alike."""
    view = np.asarray(a).view(np.ndarray)
    view.flags.writeable = False
    return view


Rows = bool | np.ndarray | None  # decode rows: None/False (none), True (all), or a bool mask [n]


def decode_flags(decode_rows: np.ndarray | bool | None) -> bool | np.ndarray:
    """True when every row is a decode row, False when none is, else the bool mask: computed once
    per step by the backend (CpuOps memoizes it), not once per matmul."""
    if decode_rows is None or isinstance(decode_rows, (bool, np.bool_)):
        return bool(decode_rows)
    mask = np.asarray(decode_rows, bool).reshape(-1)
    count = int(np.count_nonzero(mask))
    return True if count == mask.size else False if count == 0 else mask


def matmul(x: np.ndarray, w: CpuWeight, decode_rows: Rows = None, int8_prompts: bool = False) -> np.ndarray:
    """y = x @ W^T: x float32 [n, cols] (or [cols]) -> float32 [n, rows] (or [rows]).

    decode_rows (a bool mask [n], or True / False for every row) marks the rows that are generated
    tokens fed back. With quantized weights those multiply x_hat, x after an int8 round trip (ggml's q8_0
    against Q8_0, one scale per 256 values against K-quants), in integer arithmetic
    (kernels/cpu/int8_dots.py), as llama.cpp does: 1.5-3x faster at decode. Every
    other row (prompt tokens) multiplies x itself in float32, exactly, through the dequantize-and-tile
    product, which is faster on long prompts; or, where `int8_prompts` (the prompt_act "q8_0"
    policy), x with each 32 values quantized to int8, in integer arithmetic (int8_prompt.py, ~2x
    faster). A row's result depends only on its own flag and values, never on the other rows of the call."""
    x2 = _as_rows(x, w.cols)
    rows = decode_flags(decode_rows)
    n = x2.shape[0]
    if w.f32 is not None:  # not BLAS: its sums' order follows n (prompt logits then depended on how steps cut them)
        y = _tiled(w, x2)
    elif not w.int8:
        y = np.empty((n, w.rows), np.float32)
        if n == 1:
            _matvec_16bit(w.code == _F16, w.u16, x2[0], y[0])
        else:
            _matmul(w.code, w.u8, w.i8, w.u16, w.u32, x2, y)
    elif rows is True:
        y = np.empty((n, w.rows), np.float32)
        _MATMUL_INT8.pick(w.nbytes * n)(w.code, w.u8, x2, y)
    elif rows is False:
        y = _prompt_products(x2, (w,), int8_prompts)[0]
    else:  # a step that mixes prompt chunks and decode tokens
        y = np.empty((n, w.rows), np.float32)
        y[rows] = matmul(x2[rows], w, True)
        y[~rows] = matmul(x2[~rows], w, False, int8_prompts)
    return y[0] if x.ndim == 1 else y


def _prompt_products(x: np.ndarray, ws: tuple[CpuWeight, ...], int8_prompts: bool) -> list[np.ndarray]:
    """Prompt rows x [n, cols] times each of ws, transposed: where `int8_prompts`, the quantized weights
    through int8_prompt.py, x quantized once for all of them of a kind (q8_0 or q8_K, as their decode
    rows); the others (and every weight otherwise) through the float product."""
    acts: dict[bool, int8_prompt.PromptActivations] = {}  # by kind: q8_K (K-quants) or q8_0
    out = []
    for w in ws:
        if int8_prompts and w.int8:
            kind = int8_prompt.k_quant_activations(w.code)
            if kind not in acts:
                acts[kind] = int8_prompt.quantize(x, kind)
            out.append(int8_prompt.product(w.code, w.u8, acts[kind], w.rows))
        else:
            out.append(_tiled(w, x) if w.int8 else matmul(x, w, False))
    return out


def _tiled(w: CpuWeight, x: np.ndarray) -> np.ndarray:
    """Prompt rows of a quantized weight, and every row of a float32 one: the dequantize-and-tile
    product (float32 rows are tiled as they are) with the tokens padded to whole 4-token tiles, so
    that every token goes through the same tile code wherever it sits in the batch (a leftover token
    took another code path and rounded differently: decode rows, whose int8 quantization turns a
    last-bit difference into a visible one, then depended on batching)."""
    n = x.shape[0]
    pad = -n % _FLOAT_TILE_TOKENS
    if pad:
        x = np.concatenate([x, np.zeros((pad, x.shape[1]), np.float32)])
    y = np.empty((n + pad, w.rows), np.float32)
    if w.f32 is not None:
        _MATMUL_F32.pick(w.f32.size * x.shape[0])(w.f32, x, y)
    else:
        _matmul(w.code, w.u8, w.i8, w.u16, w.u32, x, y)
    return y[:n] if pad else y


def matmul_many(x: np.ndarray, ws: tuple[CpuWeight, ...], decode_rows: Rows = None,
                int8_prompts: bool = False) -> list[np.ndarray]:
    """[matmul(x, w, decode_rows, int8_prompts) for w in ws], decode rows of quantized weights in one kernel."""
    rows = decode_flags(decode_rows)
    if rows is False and all(w.cols == ws[0].cols for w in ws):
        ys = _prompt_products(_as_rows(x, ws[0].cols), ws, int8_prompts)
        return [y[0] for y in ys] if x.ndim == 1 else ys
    if rows is not True or not all(w.int8 and w.cols == ws[0].cols for w in ws):
        return [matmul(x, w, rows, int8_prompts) for w in ws]
    x2 = _as_rows(x, ws[0].cols)
    n = x2.shape[0]
    outs = tuple(np.empty((n, w.rows), np.float32) for w in ws)
    codes = np.array([w.code for w in ws])
    kernel = _MATMUL_INT8_MANY.pick(sum(w.nbytes for w in ws) * n)
    kernel(codes, tuple(w.u8 for w in ws), x2, outs, _MATVEC_ROWS if kernel is _MATMUL_INT8_MANY.parallel else SERIAL_GROUP)
    return [y[0] for y in outs] if x.ndim == 1 else list(outs)


def swiglu_matmul(x: np.ndarray, gate: CpuWeight, up: CpuWeight, decode_rows: Rows = None,
                  gelu: bool = False, int8_prompts: bool = False) -> np.ndarray:
    """silu(x @ gate^T) * (x @ up^T) (GELU-tanh in silu's place where `gelu`), the decode rows of
    quantized weights in one kernel."""
    rows = decode_flags(decode_rows)
    act = dense.geglu if gelu else dense.swiglu
    if rows is False and gate.int8 and up.int8 and up.cols == gate.cols:
        out = act(*_prompt_products(_as_rows(x, gate.cols), (gate, up), int8_prompts))
        return out[0] if x.ndim == 1 else out
    if rows is False or not (gate.int8 and up.int8 and (up.rows, up.cols) == (gate.rows, gate.cols)):
        return act(matmul(x, gate, rows, int8_prompts), matmul(x, up, rows, int8_prompts))
    x2 = _as_rows(x, gate.cols)
    out = np.empty((x2.shape[0], gate.rows), np.float32)
    if rows is True:
        _SWIGLU_INT8.pick(2 * gate.nbytes * x2.shape[0])(gate.code, gate.u8, up.code, up.u8, x2, out, gelu)
    else:  # decode rows through the fused kernel wherever they are: their result must not depend on the step
        out[rows] = swiglu_matmul(x2[rows], gate, up, True, gelu)
        out[~rows] = swiglu_matmul(x2[~rows], gate, up, False, gelu, int8_prompts)
    return out[0] if x.ndim == 1 else out


def _as_rows(x: np.ndarray, cols: int) -> np.ndarray:
    """x as C-contiguous float32 [n, cols] (a view when it already is one)."""
    x2 = dense.f32_rows(x)
    if x2.shape[1] != cols:
        raise ValueError(f"x has {x2.shape[1]} columns, weight has {cols}")
    return x2


def embedding(w: CpuWeight, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of w, dequantized: float32 [len(ids), cols]."""
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    low, high = (int(ids[0]),) * 2 if ids.size == 1 else (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if low < 0 or high >= w.rows:
        raise IndexError(f"token id out of range 0..{w.rows - 1}")
    if w.f32 is not None:
        return w.f32[ids]
    out = np.empty((ids.size, w.cols), np.float32)
    _GATHER_ROWS.pick(ids.size * w.cols)(w.code, w.u8, w.i8, w.u16, w.u32, ids, out)  # decode: one row, no pool
    return out


# --------------------------------------------------------------------------------------------------
# parallel drivers: one per operation, switching on the type code once per row
# --------------------------------------------------------------------------------------------------
@njit(parallel=True, **_JIT)
def _matvec_16bit(is_f16, u16, x, out):
    rows = out.shape[0]
    for c in prange((rows + _MATVEC_ROWS - 1) // _MATVEC_ROWS):
        for r in range(c * _MATVEC_ROWS, min(rows, (c + 1) * _MATVEC_ROWS)):
            out[r] = _dot_16bit(is_f16, u16, r, x)


def _rows_loop(tiles):
    """An inlined loop over rows first..end-1 and every token with one type's tiles (int8_dots'
    *_TILES): per row, tiles of TILE_TOKENS tokens, then the 2 or 3 tokens left over in one tile; one
    token left over (the one token of plain decode) meets two rows per tile. Each type's loop is its
    own code, so the type is switched on once per call, not once per row: a per-row switch over twelve
    types' tiles cost 1 us of a 4 us 256 x 256 Q8_0 matvec.

    One token alone (plain decode) takes a loop of its own, the row pairs and nothing else: inside the
    loop for any token count, LLVM kept the pair tile's constants on the stack and reloaded them every
    pair, and the 4-token tiles' registers around it. A one-token Q4_K layer's row groups (12 layers'
    q, k, o, gate and up, 31 MB, from DRAM, 2 threads) took 1.37 ms through it against 1.22 ms through
    the loop of pairs alone (docs/runtime.md, 2026-12-03 evening); the same tiles, the same bits."""
    tile, tile_3, tile_2 = (tiles[TILE_SIZES.index(size)] for size in (TILE_TOKENS, 3, 2))
    tile_1, tile_pair = tiles[TILE_SIZES.index(1)], tiles[ROW_PAIR]

    @njit(inline="always", **_STRICT)
    def one_token(u8, first, end, xq, xd, xs, xc, out):
        r = first
        while r + 2 <= end:
            vp = tile_pair(u8, r, xq, xd, xs, xc, 0)
            out[0, r], out[0, r + 1] = vp[0], vp[1]
            r += 2
        if r < end:
            out[0, r] = tile_1(u8, r, xq, xd, xs, xc, 0)[0]

    @njit(inline="always", **_STRICT)
    def tokens(u8, first, end, xq, xd, xs, xc, out):
        n = xq.shape[0]
        whole = n - n % TILE_TOKENS
        rest = n - whole
        r = first
        while r < end:
            pair = r + 2 <= end
            for i in range(2 if pair else 1):
                t = 0
                while t < whole:
                    v = tile(u8, r + i, xq, xd, xs, xc, t)
                    for j in range(TILE_TOKENS):
                        out[t + j, r + i] = v[j]
                    t += TILE_TOKENS
                if rest == 3:
                    v3 = tile_3(u8, r + i, xq, xd, xs, xc, whole)
                    for j in range(3):
                        out[whole + j, r + i] = v3[j]
                elif rest == 2:
                    v2 = tile_2(u8, r + i, xq, xd, xs, xc, whole)
                    out[whole, r + i], out[whole + 1, r + i] = v2[0], v2[1]
            if rest == 1:
                if pair:
                    vp = tile_pair(u8, r, xq, xd, xs, xc, whole)
                    out[whole, r], out[whole, r + 1] = vp[0], vp[1]
                else:
                    out[whole, r] = tile_1(u8, r, xq, xd, xs, xc, whole)[0]
            r += 2 if pair else 1

    @njit(inline="always", **_STRICT)
    def loop(u8, first, end, xq, xd, xs, xc, out):
        if xq.shape[0] == 1:
            one_token(u8, first, end, xq, xd, xs, xc, out)
        else:
            tokens(u8, first, end, xq, xd, xs, xc, out)

    return loop


(_ROWS_Q8_0, _ROWS_Q4_0, _ROWS_Q4_1, _ROWS_Q5_0, _ROWS_Q5_1, _ROWS_IQ4_NL, _ROWS_Q2_K, _ROWS_Q3_K, _ROWS_Q4_K, _ROWS_Q5_K,
 _ROWS_Q6_K, _ROWS_IQ4_XS) = (_rows_loop(getattr(int8_dots, f"{t.name}_TILES")) for t in (
    TensorType.Q8_0, TensorType.Q4_0, TensorType.Q4_1, TensorType.Q5_0, TensorType.Q5_1, TensorType.IQ4_NL,
    TensorType.Q2_K, TensorType.Q3_K, TensorType.Q4_K, TensorType.Q5_K, TensorType.Q6_K, TensorType.IQ4_XS))


@njit(inline="always", **_STRICT)
def _quantized_tokens(n, cols, k_quants):
    """Room for n tokens' activations: q8_0 (scales per 32 values) or, for K-quant weights, q8_K
    (scales per 256); the 32-value sums of x_hat and the quad_offsets either way; for q8_0, from
    decode_lanes.MIN_TOKENS tokens on, those that take the lanes in lanes too (decode_lanes.room)."""
    per = QK_K if k_quants else QK
    return (np.empty((n, cols), np.int8), np.empty((n, cols // per), np.float32), np.empty((n, cols // QK), np.float32),
            np.empty((n, offsets_width(cols, k_quants)), np.int32), decode_lanes.room(0 if k_quants else n, cols))


@njit(inline="always", **_STRICT)
def _activations(x, q8_0, k_quants):
    """x's tokens quantized once per format its weights need: (q8_0 arrays, q8_K arrays), each
    (quants, scales, 32-value sums); a format not needed is left with no tokens."""
    n, cols = x.shape
    xq, xd, xs, xc, xl = _quantized_tokens(n if q8_0 else 0, cols, False)
    kq, kd, ks, kc, kl = _quantized_tokens(n if k_quants else 0, cols, True)
    # a parallel region of its own costs more than a few tokens; with tokens in lanes, a thread
    # quantizes a vector's
    per = decode_lanes.tokens_per_thread(xl)
    if n < _PARALLEL_QUANTIZE_TOKENS or n <= per:
        for t in range(n):
            _quantize_token(x, t, q8_0, xq, xd, xs, xc, xl, k_quants, kq, kd, ks, kc)
    else:
        for c in prange((n + per - 1) // per):
            for t in range(c * per, min(n, (c + 1) * per)):
                _quantize_token(x, t, q8_0, xq, xd, xs, xc, xl, k_quants, kq, kd, ks, kc)
    return (xq, xd, xs, xc, xl), (kq, kd, ks, kc, kl)


@njit(inline="always", **_STRICT)
def _quantize_token(x, t, q8_0, xq, xd, xs, xc, xl, k_quants, kq, kd, ks, kc):
    if q8_0:
        quantize_activation(x[t], xq[t], xd[t], xs[t])
        if not decode_lanes.put_token(xq[t], xd[t], xs[t], t, xl):  # a token in lanes never meets the tiles
            quad_offsets(xq[t], xc[t], Q8_0_OFFSET)
    if k_quants:
        quantize_activation_k(x[t], kq[t], kd[t], ks[t])
        quad_offsets(kq[t], kc[t], Q6_K_OFFSET)


# The row-group loops: out[t, r] = row r . x_hat[t] for rows first..end-1 and every token, by tt's row
# loop (_rows_loop) over the activations of its format (q8_0's for 32-value blocks, q8_K's for
# K-quants: _activations_for). Every (row, token) result is computed by the same operations whichever
# tile computes it (int8_dots guarantees it), so batching changes no token's result.
#
# Each driver calls one of the two loops directly in its row-group loop, by whether its tokens take
# the lanes (decode_lanes.tokens_in): not through an inlined helper that picks one, whose arguments
# numba copies into variables of its own, each copy an atomic reference count (46 ns a call in a
# micro-benchmark, against 10 for the direct call). The loops are compiled functions (not inlined)
# that the serial and the parallel variant of every driver call alike: inlined into the parallel
# variant's outlined loop body, the same loop ran 1.25x slower per thread than in the serial variant
# (8192 x 384 Q8_0, one thread: 224 vs 182 us). The drivers pick each weight's activation arrays once,
# before their row-group loops: a variable that is one array or another, set in the loop, cost
# reference counts on every group (a 256 x 256 Q8_0 matvec 2.9 us against 2.2 in compiled code).


@njit(**_STRICT)
def _rows_with_lanes(tt, u8, first, end, xq, xd, xs, xc, xl, out):
    """The row-group loop with the first tokens in lanes too (xl: enough decode rows, a 32-value type):
    decode_lanes computes the same results for them at a fraction of the work, and the tiles the
    rest's."""
    k = decode_lanes.tokens_in(xl, out.shape[0])
    decode_lanes.rows(tt, u8, first, end, xl, out[:k])
    if k < out.shape[0]:
        _rows_tiles(tt, u8, first, end, xq[k:], xd[k:], xs[k:], xc[k:], out[k:])


# Compiled without numba's reference counting (it allocates nothing): a compiled function that takes
# arrays counts references to each of them on entry and exit, atomic increments and decrements that
# cost ~90 ns a call here, and this one is called for every 32 rows of every matrix (the demo MoE's
# 8192 x 256 output head: 256 calls a token, its matvec 107 -> 65 us on the Xeon, 2 threads).
@njit(_nrt=False, **_STRICT)
def _rows_tiles(tt, u8, first, end, xq, xd, xs, xc, out):
    """out[t, r] = row r . x_hat[t] for rows first..end-1 and every token, by tt's tiles."""
    if tt == _Q8_0:
        _ROWS_Q8_0(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q4_K:
        _ROWS_Q4_K(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q6_K:
        _ROWS_Q6_K(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q5_K:
        _ROWS_Q5_K(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q4_0:
        _ROWS_Q4_0(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _IQ4_XS:
        _ROWS_IQ4_XS(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q3_K:
        _ROWS_Q3_K(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q2_K:
        _ROWS_Q2_K(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q5_0:
        _ROWS_Q5_0(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q4_1:
        _ROWS_Q4_1(u8, first, end, xq, xd, xs, xc, out)
    elif tt == _Q5_1:
        _ROWS_Q5_1(u8, first, end, xq, xd, xs, xc, out)
    else:
        _ROWS_IQ4_NL(u8, first, end, xq, xd, xs, xc, out)


@njit(inline="always", **_STRICT)
def _activations_for(acts, q8_0):
    """The arrays (quants, scales, sums, quad offsets, lanes) of _activations' result `acts` in one format."""
    return acts[0] if q8_0 else acts[1]


def _matmul_int8(tt, u8, x, out):
    """out[t, r] = row r . x_hat[t] for quantized weights: each token row quantized once (int8_dots),
    each weight row read once per call for all tokens."""
    rows = out.shape[1]
    q8_0 = _Q8_0_ACTIVATIONS[tt]
    xq, xd, xs, xc, xl = _activations_for(_activations(x, q8_0, not q8_0), q8_0)
    lanes = decode_lanes.tokens_in(xl, out.shape[0]) > 0
    for c in prange((rows + _MATVEC_ROWS - 1) // _MATVEC_ROWS):
        first, end = c * _MATVEC_ROWS, min(rows, (c + 1) * _MATVEC_ROWS)
        if lanes:
            _rows_with_lanes(tt, u8, first, end, xq, xd, xs, xc, xl, out)
        else:
            _rows_tiles(tt, u8, first, end, xq, xd, xs, xc, out)


def _matmul_int8_many(tts, ws, x, outs, group_rows):
    """_matmul_int8 of one x by several weights (a layer's q, k and v) in one parallel region: x is
    quantized once per activation format its weights need, and the threads share out all the
    weights' row groups of group_rows rows together. The serial variant takes each weight whole
    (group_rows = SERIAL_GROUP): a group's weight is picked per group, a variable that is one array
    or another, and the reference counts of 16 groups were a sixth of a 512 x 256 Q8_0 q/k/v (4.6 us)."""
    formats = _Q8_0_ACTIVATIONS[tts]
    acts = _activations(x, formats.any(), not formats.all())
    xq, xd, xs, xc, xl = _activations_for(acts, formats[0])  # the first weight's format
    oq, od, osum, oc, ol = _activations_for(acts, not formats[0])  # the other (only a mixed layer has it)
    lanes, other_lanes = decode_lanes.tokens_in(xl, x.shape[0]) > 0, decode_lanes.tokens_in(ol, x.shape[0]) > 0
    groups = np.empty(len(ws) + 1, np.int64)
    groups[0] = 0
    for k in range(len(ws)):
        groups[k + 1] = groups[k] + (ws[k].shape[0] + group_rows - 1) // group_rows
    for c in prange(groups[-1]):
        k = 0
        while c >= groups[k + 1]:
            k += 1
        u8, out = ws[k], outs[k]
        first = (c - groups[k]) * group_rows
        end = min(u8.shape[0], first + group_rows)
        if formats[k] == formats[0]:
            if lanes:
                _rows_with_lanes(tts[k], u8, first, end, xq, xd, xs, xc, xl, out)
            else:
                _rows_tiles(tts[k], u8, first, end, xq, xd, xs, xc, out)
        elif other_lanes:
            _rows_with_lanes(tts[k], u8, first, end, oq, od, osum, oc, ol, out)
        else:
            _rows_tiles(tts[k], u8, first, end, oq, od, osum, oc, out)


def _swiglu_int8(tt_gate, gate, tt_up, up, x, out, gelu):
    """out = silu(x_hat @ gate^T) * (x_hat @ up^T) (gelu_tanh where `gelu`): both products and the
    activation in one pass over each row group (one parallel region instead of three kernels)."""
    n, rows = x.shape[0], out.shape[1]
    q8_gate, q8_up = _Q8_0_ACTIVATIONS[tt_gate], _Q8_0_ACTIVATIONS[tt_up]
    acts = _activations(x, q8_gate or q8_up, not (q8_gate and q8_up))
    gq, gd, gs, gc, gl = _activations_for(acts, q8_gate)
    uq, ud, us, uc, ul = _activations_for(acts, q8_up)
    g = np.empty((n, rows), np.float32)
    u = np.empty((n, rows), np.float32)
    gate_lanes, up_lanes = decode_lanes.tokens_in(gl, n) > 0, decode_lanes.tokens_in(ul, n) > 0
    for c in prange((rows + _MATVEC_ROWS - 1) // _MATVEC_ROWS):
        first, end = c * _MATVEC_ROWS, min(rows, (c + 1) * _MATVEC_ROWS)
        # the group's gate rows, then its up rows: one contiguous stream at a time for the prefetcher
        if gate_lanes:
            _rows_with_lanes(tt_gate, gate, first, end, gq, gd, gs, gc, gl, g)
        else:
            _rows_tiles(tt_gate, gate, first, end, gq, gd, gs, gc, g)
        if up_lanes:
            _rows_with_lanes(tt_up, up, first, end, uq, ud, us, uc, ul, u)
        else:
            _rows_tiles(tt_up, up, first, end, uq, ud, us, uc, u)
        if gelu:
            _gelu_times(g, u, c * _MATVEC_ROWS, end, out)
        else:
            _silu_times(g, u, c * _MATVEC_ROWS, end, out)


@njit(inline="always", **_STRICT)
def _gelu_times(g, u, first, end, out):
    """out = gelu_tanh(g) * u on columns first..end-1 of every token, as dense.geglu computes it."""
    for t in range(out.shape[0]):
        for r in range(first, end):
            out[t, r] = dense.gelu_tanh(g[t, r]) * u[t, r]


@njit(inline="always", **_STRICT)
def _silu_times(g, u, first, end, out):
    """out = silu(g) * u on columns first..end-1 of every token, as dense.swiglu computes it (g times
    dense.sigmoid's vectorizable exp, not g / (1 + libm's expf)): the one SwiGLU of the integer decode
    path (the fused layer's thread team, decoder_layer.py, calls it too)."""
    # unsigned column indices: numba's negative-index select made the loads gathers (8 x 2048 values
    # in groups of 32 columns, one thread: libm's expf 49-66 us, dense.sigmoid's 9-13)
    for t in range(out.shape[0]):
        for r in range(first, end):
            i = np.uint64(r)
            out[t, i] = dense.silu_times(g[t, i], u[t, i])


# Each integer kernel compiled serial and parallel (twin.py); below INT8_PARALLEL_MIN_WORK weight
# bytes x tokens a call runs on the calling thread, where waking the pool costs more than it gains
# (measured, Q8_0 n=1, 2 threads vs 1, min / median of 3000 alternating calls: 256 x 384 (104 kB)
# 4.7 / 5.4 vs 5.4 / 5.6 us, 384 x 384 (157 kB) 5.5 / 7.6 vs 7.2 / 7.7, 640 x 384 7.3 / 7.5 vs
# 11.1 / 11.3: the demo's q/k/v and output projections now run parallel). Both variants compute every
# (row, token) with the same operations, so the choice, which depends on n, changes no result.
INT8_PARALLEL_MIN_WORK = 1 << 17
_MATMUL_INT8 = Twin(_matmul_int8, INT8_PARALLEL_MIN_WORK, fastmath=False)
_MATMUL_INT8_MANY = Twin(_matmul_int8_many, INT8_PARALLEL_MIN_WORK, fastmath=False)
_SWIGLU_INT8 = Twin(_swiglu_int8, INT8_PARALLEL_MIN_WORK, fastmath=False)


@njit(parallel=True, **_JIT)
def _matmul(tt, u8, i8, u16, u32, x, out):
    rows, cols = out.shape[1], x.shape[1]
    for c in prange((rows + _MATMUL_ROWS - 1) // _MATMUL_ROWS):
        r0 = c * _MATMUL_ROWS
        nr = min(_MATMUL_ROWS, rows - r0)
        wbuf = np.empty((_MATMUL_ROWS, cols), np.float32)
        for i in range(nr):  # each block is dequantized once per call, whatever n is
            _dequant_row(tt, u8, i8, u16, u32, r0 + i, wbuf[i])
        _tile_product(wbuf, nr, x, out, r0)


def _matmul_f32(w, x, out):
    """_matmul for float32 weights: the same tiles, straight from the rows."""
    rows = out.shape[1]
    for c in prange((rows + _MATMUL_ROWS - 1) // _MATMUL_ROWS):
        r0 = c * _MATMUL_ROWS
        _tile_product(w[r0:r0 + _MATMUL_ROWS], min(_MATMUL_ROWS, rows - r0), x, out, r0)


# serial below PARALLEL_MIN_WORK multiply-adds: a MoE router (16 x 256, a few tokens) ran 0.9 us in a
# parallel region against 0.2 on the calling thread. Every tile is _tile_product's call either way.
_MATMUL_F32 = Twin(_matmul_f32)


def _gather_rows(tt, u8, i8, u16, u32, ids, out):
    for k in prange(ids.shape[0]):
        _dequant_row(tt, u8, i8, u16, u32, ids[k], out[k])


_GATHER_ROWS = Twin(_gather_rows, fastmath={"nnan", "ninf", "nsz", "arcp", "afn"})  # _EXACT's flags: rows as dequantized


# --------------------------------------------------------------------------------------------------
# one row . x, per type (the matvec inner loops)
#
# Each dot is a sum of per-group reductions (`t += lane(l)` over a block group's lanes) that LLVM
# vectorizes into register accumulators: no scratch array, so no store->load chain through memory,
# which lets loads run far ahead (this is what keeps DRAM-resident weights streaming at full speed).
# All loads go through ld/ld1 (no negative-index wraparound). Per-lane work is written as inline
# helpers returning a tree-shaped sum of that lane's products in the group.
# --------------------------------------------------------------------------------------------------
@njit(inline="always", **_JIT)
def _w16(is_f16, bits):
    return f16(bits) if is_f16 else bf16(bits)


@njit(**_JIT)
def _dot_16bit(is_f16, u16, r, x):
    """F16 or BF16 row r . x: one reduction over the row."""
    s = np.float32(0)
    for j in range(x.shape[0]):
        s += _w16(is_f16, ld(u16, r, j)) * ld1(x, j)
    return s


# --------------------------------------------------------------------------------------------------
# one row -> float32, per type (the n-token kernel and embedding)
# --------------------------------------------------------------------------------------------------
@njit(**_EXACT)
def _dequant_row(tt, u8, i8, u16, u32, r, out):
    if tt == _Q8_0:
        _dequant_row_q8_0(i8, u16, r, out)
    elif tt == _Q4_K:
        _dequant_row_q4_k(u8, u16, u32, r, out)
    elif tt == _Q5_K:
        _dequant_row_q5_k(u8, u16, u32, r, out)
    elif tt == _Q6_K:
        _dequant_row_q6_k(u8, i8, u16, r, out)
    elif tt == _Q4_0 or tt == _Q5_0 or tt == _IQ4_NL:
        _dequant_row_symmetric(tt, u8, u16, r, out)
    elif tt == _Q4_1 or tt == _Q5_1:
        _dequant_row_offset(tt, u8, u16, r, out)
    elif tt == _Q2_K:
        _dequant_row_q2_k(u8, u16, r, out)
    elif tt == _Q3_K:
        _dequant_row_q3_k(u8, u16, r, out)
    elif tt == _IQ4_XS:
        _dequant_row_iq4_xs(u8, u16, r, out)
    elif tt == _F16:
        for j in range(out.shape[0]):
            out[j] = f16(u16[r, j])
    else:
        for j in range(out.shape[0]):
            out[j] = bf16(u16[r, j])


@njit(**_EXACT)
def _dequant_row_q8_0(i8, u16, r, out):
    # Four blocks per pass: a one-block body is small enough for LLVM to unroll fully before its loop
    # vectorizer runs, and the unrolled code is left scalar (it cannot prove `out` and i8 disjoint).
    nb = out.shape[0] // 32
    b = 0
    while b + 4 <= nb:
        d0, d1 = f16(u16[r, 17 * b]), f16(u16[r, 17 * b + 17])
        d2, d3 = f16(u16[r, 17 * b + 34]), f16(u16[r, 17 * b + 51])
        q, y = 34 * b + 2, 32 * b
        for l in range(32):
            out[y + l] = d0 * np.float32(i8[r, q + l])
            out[y + 32 + l] = d1 * np.float32(i8[r, q + 34 + l])
            out[y + 64 + l] = d2 * np.float32(i8[r, q + 68 + l])
            out[y + 96 + l] = d3 * np.float32(i8[r, q + 102 + l])
        b += 4
    while b < nb:
        d = f16(u16[r, 17 * b])
        for l in range(32):
            out[32 * b + l] = d * np.float32(i8[r, 34 * b + 2 + l])
        b += 1


@njit(**_EXACT)
def _dequant_row_q4_k(u8, u16, u32, r, out):
    for s in range(out.shape[0] // 256):
        o = 144 * s
        hd = k4_header(u32[r, 36 * s + 1], u32[r, 36 * s + 2], u32[r, 36 * s + 3],
                       f16(u16[r, 72 * s]), f16(u16[r, 72 * s + 1]))
        for g in range(4):
            q = o + 16 + 32 * g
            y = 256 * s + 64 * g
            d0, m0, d1, m1 = hd[2 * g], hd[8 + 2 * g], hd[2 * g + 1], hd[9 + 2 * g]
            for l in range(32):
                b = u8[r, q + l]
                out[y + l] = d0 * quant(b, 0, b, 0, 0, 0) - m0
                out[y + 32 + l] = d1 * quant(b, 4, b, 0, 0, 0) - m1


@njit(**_EXACT)
def _dequant_row_q5_k(u8, u16, u32, r, out):
    for s in range(out.shape[0] // 256):
        o = 176 * s
        hd = k4_header(u32[r, 44 * s + 1], u32[r, 44 * s + 2], u32[r, 44 * s + 3],
                       f16(u16[r, 88 * s]), f16(u16[r, 88 * s + 1]))
        for g in range(4):
            q = o + 48 + 32 * g
            y = 256 * s + 64 * g
            d0, m0, d1, m1 = hd[2 * g], hd[8 + 2 * g], hd[2 * g + 1], hd[9 + 2 * g]
            for l in range(32):
                b, h = u8[r, q + l], u8[r, o + 16 + l]
                out[y + l] = d0 * quant(b, 0, h, 2 * g, 1, 0) - m0
                out[y + 32 + l] = d1 * quant(b, 4, h, 2 * g + 1, 1, 0) - m1


@njit(**_EXACT)
def _dequant_row_q6_k(u8, i8, u16, r, out):
    for s in range(out.shape[0] // 256):
        o = 210 * s
        d = f16(u16[r, 105 * s + 104])
        for h in range(2):
            ql = o + 64 * h
            qh = o + 128 + 32 * h
            y = 256 * s + 128 * h
            for quarter in range(2):
                sc = o + 192 + 8 * h + quarter
                s0, s1 = d * np.float32(i8[r, sc]), d * np.float32(i8[r, sc + 2])
                s2, s3 = d * np.float32(i8[r, sc + 4]), d * np.float32(i8[r, sc + 6])
                for l in range(16 * quarter, 16 * quarter + 16):
                    a, b, hb = u8[r, ql + l], u8[r, ql + 32 + l], u8[r, qh + l]
                    out[y + l] = s0 * quant(a, 0, hb, 0, 3, 32)
                    out[y + 32 + l] = s1 * quant(b, 0, hb, 2, 3, 32)
                    out[y + 64 + l] = s2 * quant(a, 4, hb, 4, 3, 32)
                    out[y + 96 + l] = s3 * quant(b, 4, hb, 6, 3, 32)


@njit(**_EXACT)
def _dequant_row_symmetric(tt, u8, u16, r, out):
    """Q4_0, Q5_0 and IQ4_NL rows: d f16 | (qh u32) | qs[16], x = d * (q - 8), d * (q - 16), or
    d * IQ4_LEVELS[q]."""
    size = 22 if tt == _Q5_0 else 18
    qs = 6 if tt == _Q5_0 else 2
    for b in range(out.shape[0] // 32):
        o, y = size * b, 32 * b
        d = f16(u16[r, o // 2])
        if tt == _Q5_0:
            qh = fifth_bits(u16, r, o // 2 + 1)
            for l in range(16):
                v = u8[r, o + qs + l]
                out[y + l] = d * quant(v, 0, qh, l, 1, 16)
                out[y + 16 + l] = d * quant(v, 4, qh, l + 16, 1, 16)
        elif tt == _Q4_0:
            for l in range(16):
                v = u8[r, o + qs + l]
                out[y + l] = d * quant(v, 0, v, 0, 0, 8)
                out[y + 16 + l] = d * quant(v, 4, v, 0, 0, 8)
        else:
            for l in range(16):
                v = u8[r, o + qs + l]
                out[y + l] = d * _IQ4_LEVELS[v & 15]
                out[y + 16 + l] = d * _IQ4_LEVELS[v >> 4]


@njit(**_EXACT)
def _dequant_row_offset(tt, u8, u16, r, out):
    """Q4_1 and Q5_1 rows: d f16 | m f16 | (qh u32) | qs[16], x = d * q + m."""
    fifth = tt == _Q5_1
    size = 24 if fifth else 20
    for b in range(out.shape[0] // 32):
        o, y = size * b, 32 * b
        d, m = f16(u16[r, o // 2]), f16(u16[r, o // 2 + 1])
        qh = fifth_bits(u16, r, o // 2 + 2) if fifth else np.uint32(0)
        qs = o + (8 if fifth else 4)
        for l in range(16):
            v = u8[r, qs + l]
            out[y + l] = d * quant(v, 0, qh, l, 1, 0) + m
            out[y + 16 + l] = d * quant(v, 4, qh, l + 16, 1, 0) + m


@njit(**_EXACT)
def _dequant_row_q2_k(u8, u16, r, out):
    """scales[16] | qs[64] | d | dmin: value 128h + 32j + l is (qs[32h + l] >> 2j) & 3."""
    for s in range(out.shape[0] // 256):
        o = 84 * s
        d, dmin = f16(u16[r, 42 * s + 40]), f16(u16[r, 42 * s + 41])
        for h in range(2):
            for j in range(4):
                for half in range(2):
                    sc = u8[r, o + 8 * h + 2 * j + half]
                    dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                    q, y = o + 16 + 32 * h + 16 * half, 256 * s + 128 * h + 32 * j + 16 * half
                    for l in range(16):
                        out[y + l] = dl * quant3(u8[r, q + l], 2 * j, 0, 0, 0, 0) - ml


@njit(**_EXACT)
def _dequant_row_q3_k(u8, u16, r, out):
    """hmask[32] | qs[64] | scales[12] | d: q2_K's low bits, bit 2 from hmask, q = u - 4."""
    for s in range(out.shape[0] // 256):
        o = 110 * s
        d = f16(u16[r, 55 * s + 54])
        for h in range(2):
            for j in range(4):
                for half in range(2):
                    dl = d * q3_k_scale(u8, r, o, 8 * h + 2 * j + half)
                    q, hm = o + 32 + 32 * h + 16 * half, o + 16 * half
                    y = 256 * s + 128 * h + 32 * j + 16 * half
                    for l in range(16):
                        out[y + l] = dl * quant3(u8[r, q + l], 2 * j, u8[r, hm + l], 4 * h + j, 1, 4)


@njit(**_EXACT)
def _dequant_row_iq4_xs(u8, u16, r, out):
    """d f16 | scales_h u16 | scales_l[4] | qs[128]: eight IQ4_NL-like sub-blocks with 6-bit scales."""
    for s in range(out.shape[0] // 256):
        o = 136 * s
        d, high = f16(u16[r, 68 * s]), np.int32(u16[r, 68 * s + 1])
        for j in range(8):
            ls = ((np.int32(u8[r, o + 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
            dl = d * np.float32(ls - 32)
            q, y = o + 8 + 16 * j, 256 * s + 32 * j
            for l in range(16):
                v = u8[r, q + l]
                out[y + l] = dl * _IQ4_LEVELS[v & 15]
                out[y + 16 + l] = dl * _IQ4_LEVELS[v >> 4]


# --------------------------------------------------------------------------------------------------
# dequantized rows x n tokens
# --------------------------------------------------------------------------------------------------
@njit(**_JIT)
def _tile_product(wbuf, nr, x, out, r0):
    """out[t, r0 + i] = wbuf[i] . x[t] for i < nr and every token t.

    Register tiles of rows x 4 tokens: each loaded weight vector feeds 4 FMAs and each token vector
    one per row of the tile, so the loop is bound by FMAs, not loads. The tile is as tall as the
    vector registers allow without spilling: 4 rows (16 accumulators) with AVX-512's 32 registers
    (measured 1.45x faster than 2 rows on Zen 4), 2 rows (8 accumulators) with AVX2's 16 (measured
    1.2-1.3x faster than 4 rows at 8 and 16 tokens on Zen 3). Tokens are the outer loop so a 4-token
    slice of x stays in L1 while the (L2-resident) dequantized rows stream past it; leftover tokens
    go one at a time against 4 rows.
    """
    n = x.shape[0]
    t = 0
    while t + 4 <= n:
        i = 0
        if _WIDE_TILES:
            while i + 4 <= nr:
                _tile_4x4(wbuf, i, x, t, out, r0)
                i += 4
        else:
            while i + 2 <= nr:
                _tile_2x4(wbuf, i, x, t, out, r0)
                i += 2
        while i < nr:
            _tile_1x4(wbuf, i, x, t, out, r0)
            i += 1
        t += 4
    while t < n:  # leftover tokens, one at a time
        i = 0
        while i + 4 <= nr:
            _tile_4x1(wbuf, i, x, t, out, r0)
            i += 4
        while i < nr:
            out[t, r0 + i] = _dot_f32(wbuf[i], x[t])
            i += 1
        t += 1


@njit(inline="always", **_JIT)
def _tile_4x4(wbuf, i, x, t, out, r0):
    w0, w1, w2, w3 = wbuf[i], wbuf[i + 1], wbuf[i + 2], wbuf[i + 3]
    x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0)
    for k in range(x.shape[1]):
        a00 += w0[k] * x0[k]
        a01 += w0[k] * x1[k]
        a02 += w0[k] * x2[k]
        a03 += w0[k] * x3[k]
        a10 += w1[k] * x0[k]
        a11 += w1[k] * x1[k]
        a12 += w1[k] * x2[k]
        a13 += w1[k] * x3[k]
        a20 += w2[k] * x0[k]
        a21 += w2[k] * x1[k]
        a22 += w2[k] * x2[k]
        a23 += w2[k] * x3[k]
        a30 += w3[k] * x0[k]
        a31 += w3[k] * x1[k]
        a32 += w3[k] * x2[k]
        a33 += w3[k] * x3[k]
    r = r0 + i
    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = a00, a01, a02, a03
    out[t, r + 1], out[t + 1, r + 1], out[t + 2, r + 1], out[t + 3, r + 1] = a10, a11, a12, a13
    out[t, r + 2], out[t + 1, r + 2], out[t + 2, r + 2], out[t + 3, r + 2] = a20, a21, a22, a23
    out[t, r + 3], out[t + 1, r + 3], out[t + 2, r + 3], out[t + 3, r + 3] = a30, a31, a32, a33


@njit(inline="always", **_JIT)
def _tile_2x4(wbuf, i, x, t, out, r0):
    w0, w1 = wbuf[i], wbuf[i + 1]
    x0, x1, x2, x3 = x[t], x[t + 1], x[t + 2], x[t + 3]
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
    for k in range(x.shape[1]):
        a00 += w0[k] * x0[k]
        a01 += w0[k] * x1[k]
        a02 += w0[k] * x2[k]
        a03 += w0[k] * x3[k]
        a10 += w1[k] * x0[k]
        a11 += w1[k] * x1[k]
        a12 += w1[k] * x2[k]
        a13 += w1[k] * x3[k]
    out[t, r0 + i], out[t + 1, r0 + i], out[t + 2, r0 + i], out[t + 3, r0 + i] = a00, a01, a02, a03
    r = r0 + i + 1
    out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = a10, a11, a12, a13


@njit(inline="always", **_JIT)
def _tile_1x4(wbuf, i, x, t, out, r0):
    a0, a1, a2, a3 = four_dots(wbuf[i], x[t], x[t + 1], x[t + 2], x[t + 3])
    out[t, r0 + i], out[t + 1, r0 + i], out[t + 2, r0 + i], out[t + 3, r0 + i] = a0, a1, a2, a3


@njit(inline="always", **_JIT)
def _tile_4x1(wbuf, i, x, t, out, r0):
    a0, a1, a2, a3 = four_dots(x[t], wbuf[i], wbuf[i + 1], wbuf[i + 2], wbuf[i + 3])
    out[t, r0 + i], out[t, r0 + i + 1], out[t, r0 + i + 2], out[t, r0 + i + 3] = a0, a1, a2, a3


@njit(inline="always", **_JIT)
def four_dots(v, r0, r1, r2, r3):
    """v . r0, v . r1, v . r2, v . r3 (float32 rows as long as v): four independent vector sums in
    one pass over v; the loop of the float tiles below and of the attention scores (paged_attention.py)."""
    a0 = a1 = a2 = a3 = np.float32(0)
    for k in range(v.shape[0]):
        a0 += v[k] * r0[k]
        a1 += v[k] * r1[k]
        a2 += v[k] * r2[k]
        a3 += v[k] * r3[k]
    return a0, a1, a2, a3


@njit(inline="always", **_JIT)
def _dot_f32(w, x):
    a = np.float32(0)
    for k in range(x.shape[0]):
        a += w[k] * x[k]
    return a
