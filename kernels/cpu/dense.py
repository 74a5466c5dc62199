"""Numba CPU kernels for the ops API's dense (unquantized) primitives: rmsnorm, rope, q/k norm with
rope fused, SwiGLU and softmax. All are nogil so the daemon's I/O loop keeps running while they compute.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ember.kernels.cpu.quant_bits import ieee_div
from ember.kernels.cpu.twin import JIT, Twin


@njit(inline="always", **JIT)
def _inv_rms(x, eps):  # type: ignore[no-untyped-def]
    d = x.shape[0]
    ss = 0.0
    for j in range(d):
        ss += x[j] * x[j]
    return 1.0 / math.sqrt(ss / d + eps)


@njit(inline="always", **JIT)
def _norm_row(x, w, eps, out):  # type: ignore[no-untyped-def]
    """out = x / rms(x) * w for one row (out may be x itself: every value is read before it is written)."""
    inv = _inv_rms(x, eps)
    for j in range(x.shape[0]):
        out[j] = x[j] * inv * w[j]


def _rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    for r in prange(x.shape[0]):
        _norm_row(x[r], w, eps, out[r])


_RMSNORM = Twin(_rmsnorm_rows)


@njit(inline="always", **JIT)
def _add_norm_row(x, y, w, eps, scale, out):  # type: ignore[no-untyped-def]
    """out = (x + y / rms(y) * w) * scale for one row."""
    inv = _inv_rms(y, eps)
    for j in range(y.shape[0]):
        out[j] = (x[j] + y[j] * inv * w[j]) * scale


def _add_rmsnorm_rows(x: np.ndarray, y: np.ndarray, w: np.ndarray, eps: float, scale: float, out: np.ndarray) -> None:
    for r in prange(x.shape[0]):
        _add_norm_row(x[r], y[r], w, eps, scale, out[r])


_ADD_RMSNORM = Twin(_add_rmsnorm_rows)


def add_rmsnorm(x: np.ndarray, y: np.ndarray, w: np.ndarray, eps: float, scale: float = 1.0) -> np.ndarray:
    """(x + rmsnorm(y, w)) * scale: a residual add of a normed branch (Gemma's post-norms), one kernel."""
    x2, y2 = f32_rows(x), f32_rows(y)
    out = np.empty_like(x2)
    _ADD_RMSNORM.pick(y2.size)(x2, y2, w, eps, scale, out)
    return out.reshape(x.shape)


def f32_rows(x: np.ndarray) -> np.ndarray:
    """x as C-contiguous float32 rows [-1, last axis]: a view when it already is (the decode path)."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, np.float32)
    return x.reshape(-1, x.shape[-1])


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x2 = f32_rows(x)
    out = np.empty_like(x2)
    _RMSNORM.pick(x2.size)(x2, w, eps, out)
    return out.reshape(x.shape)


@njit(inline="always", **JIT)
def _rope_pair(a, b, position, inv_freq, interleaved):  # type: ignore[no-untyped-def]
    """Rotate every head of one token's a [heads, hd] and b [heads', hd] (q and k) in place: the first
    2 * len(inv_freq) dimensions of each head, the rest left alone (partial rotary)."""
    half = inv_freq.shape[0]
    for p in range(half):
        # float64 angle: positions reach 1e5+, where float32 would lose the phase
        angle = float(position) * float(inv_freq[p])
        c, s = math.cos(angle), math.sin(angle)
        ia, ib = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
        for h in range(a.shape[0]):
            u, v = a[h, ia], a[h, ib]
            a[h, ia] = u * c - v * s
            a[h, ib] = u * s + v * c
        for h in range(b.shape[0]):
            u, v = b[h, ia], b[h, ib]
            b[h, ia] = u * c - v * s
            b[h, ib] = u * s + v * c


def _rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> None:
    for i in prange(x.shape[0]):
        _rope_pair(x[i], x[i, :0], positions[i], inv_freq, interleaved)


_ROPE = Twin(_rope)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    _ROPE.pick(x.size * 8)(x, positions.astype(np.int64), inv_freq, interleaved)
    return x


def _qk_norm_rope(q: np.ndarray, k: np.ndarray, q_norm: np.ndarray, k_norm: np.ndarray, normed: bool, eps: float,
                  positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> None:
    for i in prange(q.shape[0]):
        if normed:
            for h in range(q.shape[1]):
                _norm_row(q[i, h], q_norm, eps, q[i, h])
            for h in range(k.shape[1]):
                _norm_row(k[i, h], k_norm, eps, k[i, h])
        _rope_pair(q[i], k[i], positions[i], inv_freq, interleaved)


_QK_NORM_ROPE = Twin(_qk_norm_rope)


def qk_norm_rope(q: np.ndarray, k: np.ndarray, q_norm: np.ndarray | None, k_norm: np.ndarray | None, eps: float,
                 positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-head rmsnorm of q and k [n, heads, hd] (when the model has q/k norms), then rope on both: one
    kernel where the unfused path takes four. In place on float32 C-contiguous inputs."""
    q = q if q.dtype == np.float32 and q.flags.c_contiguous else np.ascontiguousarray(q, np.float32)
    k = k if k.dtype == np.float32 and k.flags.c_contiguous else np.ascontiguousarray(k, np.float32)
    normed = q_norm is not None
    unused = inv_freq[:0]
    _QK_NORM_ROPE.pick((q.size + k.size) * 8)(q, k, q_norm if normed else unused, k_norm if normed else unused,
                                             normed, eps, positions.astype(np.int64), inv_freq, interleaved)
    return q, k


@njit(inline="always", fastmath=True, nogil=True, cache=True)
def exp_nonpositive(x):  # type: ignore[no-untyped-def]
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
    return (p * f + np.float32(1.0)) * pow2(k) if x > np.float32(-87.0) else np.float32(0.0)


@intrinsic
def pow2(typingctx, k):  # type: ignore[no-untyped-def]
    """float32 2^k for an int32 k in [-126, 127]: the exponent bits, bitcast (numba has no bitcast)."""
    if not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        biased = builder.add(builder.trunc(args[0], i32) if args[0].type.width > 32 else args[0], ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(k), codegen


@njit(inline="always", **JIT)
def sigmoid(x):  # type: ignore[no-untyped-def]
    """1 / (1 + e^-x) in float32 from exp_nonpositive of -|x| (e^-x where x >= 0, else e^x / (1 + e^x)):
    arithmetic and selects only, so its loops vectorize (libm's exp goes one value at a time). IEEE's
    division (1 + e >= 1, so the same quotient): numba's `/` checks for zero, a branch per value that
    kept the loops around it scalar (8 x 2048 SwiGLU values, one thread: 88-116 -> 9-13 us)."""
    e = exp_nonpositive(-abs(x))
    return ieee_div(np.float32(1) if x >= np.float32(0) else e, np.float32(1) + e)


@njit(inline="always", **JIT)
def silu_times(g, u):  # type: ignore[no-untyped-def]
    """silu(g) * u, as every SwiGLU here computes it (dense's and the integer decode path's: the
    same expression in one place, so their bits stay equal)."""
    return g * sigmoid(g) * u


def _swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    g, u, o = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    for i in prange(g.size):
        o[i] = silu_times(g[i], u[i])


_SWIGLU = Twin(_swiglu, fastmath=False)  # strict: a vector lane and the scalar tail round alike


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    out = np.empty_like(gate)
    _SWIGLU.pick(gate.size * 8)(np.ascontiguousarray(gate), np.ascontiguousarray(up), out)
    return out


@njit(inline="always", **JIT)
def gelu_tanh(x):  # type: ignore[no-untyped-def]
    """GELU's tanh approximation, 0.5 x (1 + tanh(u)), as the equal x * sigmoid(2u): one exp, no tanh,
    in float32 (torch's gelu(approximate="tanh") computes in float32 too); u = sqrt(2/pi) (x + 0.044715 x^3)."""
    u = np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x)
    return x * sigmoid(np.float32(2) * u)  # sigmoid's exp never meets an inf (fastmath code may not)


def _geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    g, u, o = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    for i in prange(g.size):
        o[i] = gelu_tanh(g[i]) * u[i]


_GEGLU = Twin(_geglu, fastmath=False)  # as _SWIGLU


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu_tanh(gate) * up (kernels/reference/dense.py)."""
    return _elementwise(_GEGLU, gate, up, 16)


def _softcap(x: np.ndarray, cap: float, out: np.ndarray) -> None:
    a, o = x.reshape(-1), out.reshape(-1)
    for i in prange(a.size):
        o[i] = cap * math.tanh(np.float64(a[i]) / cap)


_SOFTCAP = Twin(_softcap)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _SOFTCAP.pick(x.size * 16)(x, float(cap), out)
    return out


def _sigmoid_mul(x: np.ndarray, gate: np.ndarray, out: np.ndarray) -> None:
    a, g, o = x.reshape(-1), gate.reshape(-1), out.reshape(-1)
    for i in prange(a.size):
        o[i] = a[i] / (1.0 + math.exp(-g[i]))


_SIGMOID_MUL = Twin(_sigmoid_mul)


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    return _elementwise(_SIGMOID_MUL, x, gate, 8)


def _elementwise(kernel: Twin, x: np.ndarray, other: np.ndarray, cost: int) -> np.ndarray:
    """kernel(x, other, out) over float32 C-contiguous copies (views where they already are), run
    parallel from `cost` x size work on (Twin.pick)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    kernel.pick(x.size * cost)(x, np.ascontiguousarray(other, np.float32), out)
    return out


@njit(**JIT)
def softplus_gate_row(x, gate):  # type: ignore[no-untyped-def]
    """One token's attention output x [heads, hd] times softplus of its gate, one value per head
    (gate [heads]) or per element (gate [heads * hd]), in place. Laguna's output gate: the op and the
    fused decoder layer both call this compiled function, so the two give the same bits."""
    heads, hd = x.shape
    per_head = gate.size == heads
    for h in range(heads):
        for j in range(hd):
            g = gate[h] if per_head else gate[h * hd + j]
            x[h, j] *= g if g > np.float32(20) else np.float32(math.log1p(math.exp(g)))


@njit(**JIT)
def _softplus_gate(x, gate):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        softplus_gate_row(x[i], gate[i])


def softplus_gate(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    out = np.array(x, np.float32)  # a copy: the op returns a new array
    _softplus_gate(out, np.ascontiguousarray(gate, np.float32))
    return out


def _softmax_rows(x: np.ndarray, out: np.ndarray) -> None:
    rows, d = x.shape
    for r in prange(rows):
        best = -np.inf
        for j in range(d):
            best = max(best, x[r, j])
        total = 0.0
        for j in range(d):
            e = math.exp(x[r, j] - best)
            out[r, j] = e
            total += e
        for j in range(d):
            out[r, j] /= total


_SOFTMAX = Twin(_softmax_rows)


def softmax(x: np.ndarray) -> np.ndarray:
    x2 = f32_rows(x)
    out = np.empty_like(x2)
    _SOFTMAX.pick(x2.size * 8)(x2, out)
    return out.reshape(x.shape)
