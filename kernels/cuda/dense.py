"""numba.cuda kernels for the dense primitives: rmsnorm, rope (both layouts), SwiGLU, the sigmoid
output gate, softmax, and the greedy sampler's argmax over logits rows.

Row-wise kernels (rmsnorm, softmax, argmax) run one block per row and reduce through the helpers of
device.py; elementwise ones (rope, SwiGLU) run one thread per item. All loop over whatever a launch
does not cover, so any grid is correct.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64

from ember.kernels.cuda.device import THREADS, block_argmax, block_max, block_sum, flat_grid, grid
from ember.kernels.cuda.device_array import DeviceArray, empty


def _rows(x: DeviceArray) -> DeviceArray:
    return x.reshape(-1, x.shape[-1])


@cuda.jit
def _rmsnorm(x, w, eps, out):  # type: ignore[no-untyped-def]
    scratch = cuda.shared.array(THREADS, float32)
    t, width = cuda.threadIdx.x, cuda.blockDim.x
    d = x.shape[1]
    for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        ss = float32(0)
        for j in range(t, d, width):
            ss += x[r, j] * x[r, j]
        inv = float32(1) / math.sqrt(block_sum(ss, scratch) / d + eps)
        for j in range(t, d, width):
            out[r, j] = x[r, j] * inv * w[j]


def rmsnorm(x: DeviceArray, w: DeviceArray, eps: float) -> DeviceArray:
    x2 = _rows(x)
    out = empty(x2.shape)
    if x2.shape[0]:
        _rmsnorm[grid(x2.shape[0])](x2.raw, w.raw, float32(eps), out.raw)
    return out.reshape(x.shape)


@cuda.jit
def _rope(x, positions, inv_freq, interleaved):  # type: ignore[no-untyped-def]
    # one item = (token, head, rotary pair), in place; the first 2 * len(inv_freq) dimensions of each
    # head rotate, the rest pass through (partial rotary)
    n, heads, hd = x.shape
    half = inv_freq.shape[0]
    for item in range(cuda.grid(1), n * heads * half, cuda.gridsize(1)):
        i, h, p = item // (heads * half), (item // half) % heads, item % half
        # float64 angle: positions reach 1e5+, where float32 would lose the phase
        angle = float(positions[i]) * float(inv_freq[p])
        c, s = math.cos(angle), math.sin(angle)
        ia, ib = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
        u, v = x[i, h, ia], x[i, h, ib]
        x[i, h, ia] = u * c - v * s
        x[i, h, ib] = u * s + v * c


def rope(x: DeviceArray, positions: DeviceArray, inv_freq: DeviceArray, interleaved: bool) -> DeviceArray:
    """In place on x [n, heads, hd]; returns x."""
    n, heads, _ = x.shape
    if x.size:
        _rope[flat_grid(n * heads * inv_freq.shape[0])](x.raw, positions.raw, inv_freq.raw, interleaved)
    return x


@cuda.jit
def _swiglu(gate, up, out):  # type: ignore[no-untyped-def]
    for i in range(cuda.grid(1), gate.size, cuda.gridsize(1)):
        g = gate[i]
        out[i] = g / (float32(1) + math.exp(-g)) * up[i]


def swiglu(gate: DeviceArray, up: DeviceArray) -> DeviceArray:
    out = empty(gate.shape)
    if gate.size:
        _swiglu[flat_grid(gate.size)](gate.flat(), up.flat(), out.flat())
    return out


@cuda.jit
def _sigmoid_mul(x, gate, out):  # type: ignore[no-untyped-def]
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = x[i] / (float32(1) + math.exp(-gate[i]))


def sigmoid_mul(x: DeviceArray, gate: DeviceArray) -> DeviceArray:
    """x * sigmoid(gate), elementwise (gated attention's output gate)."""
    out = empty(x.shape)
    if x.size:
        _sigmoid_mul[flat_grid(x.size)](x.flat(), gate.flat(), out.flat())
    return out


@cuda.jit
def _softmax(x, out):  # type: ignore[no-untyped-def]
    scratch = cuda.shared.array(THREADS, float32)
    t, width = cuda.threadIdx.x, cuda.blockDim.x
    d = x.shape[1]
    for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        best = -math.inf
        for j in range(t, d, width):
            best = max(best, x[r, j])
        best = block_max(float32(best), scratch)
        total = float32(0)
        for j in range(t, d, width):
            e = math.exp(x[r, j] - best)
            out[r, j] = e
            total += e
        total = block_sum(total, scratch)
        for j in range(t, d, width):
            out[r, j] /= total


def softmax(x: DeviceArray) -> DeviceArray:
    x2 = _rows(x)
    out = empty(x2.shape)
    if x2.shape[0]:
        _softmax[grid(x2.shape[0])](x2.raw, out.raw)
    return out.reshape(x.shape)


@cuda.jit
def _argmax_rows(x, rows, out):  # type: ignore[no-untyped-def]
    scratch = cuda.shared.array(THREADS, float32)
    iscratch = cuda.shared.array(THREADS, int64)
    t, width = cuda.threadIdx.x, cuda.blockDim.x
    d = x.shape[1]
    for k in range(cuda.blockIdx.x, rows.shape[0], cuda.gridDim.x):
        r = rows[k]
        best, at = float32(-math.inf), int64(d)  # a lane with no columns loses every comparison
        for j in range(t, d, width):
            if x[r, j] > best or at == d:
                best, at = x[r, j], int64(j)
        best, at = block_argmax(best, at, scratch, iscratch)
        if t == 0:
            out[k] = at


def argmax_rows(x: DeviceArray, rows: DeviceArray) -> DeviceArray:
    """The first index of the largest value of each of x's `rows` (np.argmax's choice): greedy
    sampling on the device, so only token ids cross to the host."""
    out = empty((len(rows),), np.int64)
    if len(rows):
        _argmax_rows[grid(len(rows))](x.raw, rows.raw, out.raw)
    return out
