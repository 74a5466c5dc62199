"""Plain numpy references of the ops API's dense kernels: the oracle the backends are tested against.

Written for clarity, in float64 where it matters, never for speed. Quantized formats have their own
reference in quant_reference.py.
"""
from __future__ import annotations

import numpy as np


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv * w).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotary embedding of the first 2 * len(inv_freq) dimensions of each head; the rest pass through."""
    rot = 2 * len(inv_freq)
    if rot < x.shape[-1]:
        return np.concatenate([rope(x[..., :rot], positions, inv_freq, interleaved), x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    angles = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]  # [n, half]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x64 = x.astype(np.float64)
    if interleaved:
        a, b = x64[..., 0::2], x64[..., 1::2]
    else:
        a, b = x64[..., :half], x64[..., half:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x64)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :half], out[..., half:] = ra, rb
    return out.astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), x itself past 20 (where they agree in float32), as torch's softplus and ggml's."""
    x = np.asarray(x, np.float32)
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def softplus_gate(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """x [n, heads, hd] times softplus(gate), gate [n, heads] (a value a head) or [n, heads * hd]."""
    n, heads, hd = x.shape
    return (x * softplus(gate).reshape(n, heads, -1)).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, window: int = 0) -> np.ndarray:
    """Causal GQA attention of q [n, hq, hd] at positions start.. over k, v [kv_heads, positions, hd];
    with window > 0 each query sees its last `window` keys only."""
    n, hq, _ = q.shape
    group = hq // k.shape[0]
    out = np.empty(q.shape, np.float64)
    for i in range(n):
        visible = start + i + 1
        first = max(0, visible - window) if window > 0 else 0
        for h in range(hq):
            kh, vh = (x[h // group, first:visible].astype(np.float64) for x in (k, v))
            s = kh @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh
    return out.astype(np.float32)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (torch's gelu(approximate="tanh"), transformers' gelu_pytorch_tanh)."""
    x64 = np.asarray(x, np.float64)
    return 0.5 * x64 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x64 + 0.044715 * x64**3)))


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return (gelu_tanh(gate) * up).astype(np.float32)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap): x squashed into (-cap, cap), near x where |x| << cap."""
    return (cap * np.tanh(np.asarray(x, np.float64) / cap)).astype(np.float32)


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) / (1.0 + np.exp(-gate.astype(np.float64)))).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
