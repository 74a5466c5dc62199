"""Numba CPU kernels for the ops API's dense (unquantized) primitives: rmsnorm, rope, SwiGLU and
softmax. All are nogil so the daemon's I/O loop keeps running while they compute.
"""
from __future__ import annotations

import math

import numpy as np
from numba import prange

from ember.kernels.cpu.twin import Twin


def _rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    rows, d = x.shape
    for r in prange(rows):
        ss = 0.0
        for j in range(d):
            ss += x[r, j] * x[r, j]
        inv = 1.0 / math.sqrt(ss / d + eps)
        for j in range(d):
            out[r, j] = x[r, j] * inv * w[j]


_RMSNORM = Twin(_rmsnorm_rows)


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


def _rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> None:
    n, heads, hd = x.shape
    half = hd // 2
    for i in prange(n):
        for p in range(half):
            # float64 angle: positions reach 1e5+, where float32 would lose the phase
            angle = float(positions[i]) * float(inv_freq[p])
            c, s = math.cos(angle), math.sin(angle)
            ia, ib = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
            for h in range(heads):
                a, b = x[i, h, ia], x[i, h, ib]
                x[i, h, ia] = a * c - b * s
                x[i, h, ib] = a * s + b * c


_ROPE = Twin(_rope)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    _ROPE.pick(x.size * 8)(x, positions.astype(np.int64), inv_freq, interleaved)
    return x


def _swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    g, u, o = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    for i in prange(g.size):
        o[i] = g[i] / (1.0 + math.exp(-g[i])) * u[i]


_SWIGLU = Twin(_swiglu)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    out = np.empty_like(gate)
    _SWIGLU.pick(gate.size * 8)(np.ascontiguousarray(gate), np.ascontiguousarray(up), out)
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
