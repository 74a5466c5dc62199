"""Numba CPU kernels for the ops API's dense (unquantized) primitives: rmsnorm, rope, GQA attention,
SwiGLU and softmax. All are nogil so the daemon's I/O loop keeps running while they compute.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_JIT = dict(parallel=True, fastmath=True, cache=True, nogil=True)


@njit(**_JIT)
def _rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    rows, d = x.shape
    for r in prange(rows):
        ss = 0.0
        for j in range(d):
            ss += x[r, j] * x[r, j]
        inv = 1.0 / math.sqrt(ss / d + eps)
        for j in range(d):
            out[r, j] = x[r, j] * inv * w[j]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _rmsnorm_rows(x2, w, eps, out)
    return out.reshape(x.shape)


@njit(**_JIT)
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


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    _rope(x, positions.astype(np.int64), inv_freq, interleaved)
    return x


@njit(**_JIT)
def _attention(q, k, v, start, scale, out):  # type: ignore[no-untyped-def]
    n, hq, hd = q.shape
    group = hq // k.shape[0]
    for task in prange(n * hq):
        i, h = task // hq, task % hq
        kv = h // group
        visible = start + i + 1
        scores = np.empty(visible, np.float32)
        best = -np.inf
        for t in range(visible):
            s = 0.0
            for j in range(hd):
                s += q[i, h, j] * k[kv, t, j]
            s *= scale
            scores[t] = s
            best = max(best, s)
        total = 0.0
        for t in range(visible):
            scores[t] = math.exp(scores[t] - best)
            total += scores[t]
        acc = np.zeros(hd, np.float32)
        for t in range(visible):
            p = scores[t]
            for j in range(hd):
                acc[j] += p * v[kv, t, j]
        for j in range(hd):
            out[i, h, j] = acc[j] / total


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float) -> np.ndarray:
    out = np.empty_like(q)
    _attention(q, k, v, start, np.float32(scale), out)
    return out


@njit(**_JIT)
def _swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    g, u, o = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    for i in prange(g.size):
        o[i] = g[i] / (1.0 + math.exp(-g[i])) * u[i]


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    out = np.empty_like(gate)
    _swiglu(np.ascontiguousarray(gate), np.ascontiguousarray(up), out)
    return out


@njit(**_JIT)
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


def softmax(x: np.ndarray) -> np.ndarray:
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(x2)
    _softmax_rows(x2, out)
    return out.reshape(x.shape)
