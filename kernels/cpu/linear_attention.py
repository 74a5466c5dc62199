"""Numba CPU kernels of the linear-attention (Gated DeltaNet) layers: the causal conv1d over q/k/v with
its per-sequence window, and the gated delta rule with its per-sequence, per-head state.

A step's tokens come from several sequences, each a contiguous run (seq_starts); a sequence's state
lives at states[slot]. A run that starts at position 0 starts from a zero state. The delta rule runs a
one-token run (decode) as the recurrence and longer runs (prompt chunks) in the chunked form: matrix
products over CHUNK tokens, not a loop of rank-1 state updates (kernels/reference/linear_attention.py
has both, in numpy, and the equations).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ember.kernels.cpu.twin import JIT, Twin

CHUNK = 64  # tokens per chunk of the chunked delta rule (as the Hugging Face and fla kernels)
_CONV_CHANNELS = 64  # channels per task of the conv kernel


@njit(inline="always", **JIT)
def _head_inputs(qkv, a, b, A, dt_bias, first, n, h, kh, k_heads, k_dim, v_dim, q, k, v, g, beta):  # type: ignore[no-untyped-def]
    """One value head's inputs of a run: q and k of its key head L2-normalised (q also scaled by
    k_dim^-1/2), v, the decay g = A softplus(a + dt_bias) and beta = sigmoid(b)."""
    q_off, k_off, v_off = kh * k_dim, (k_heads + kh) * k_dim, 2 * k_heads * k_dim + h * v_dim
    scale = 1.0 / math.sqrt(k_dim)
    for t in range(n):
        row = qkv[first + t]
        qq = 0.0
        kk = 0.0
        for i in range(k_dim):
            qq += row[q_off + i] * row[q_off + i]
            kk += row[k_off + i] * row[k_off + i]
        qs = scale / math.sqrt(qq + 1e-6)
        ks = 1.0 / math.sqrt(kk + 1e-6)
        for i in range(k_dim):
            q[t, i] = row[q_off + i] * qs
            k[t, i] = row[k_off + i] * ks
        for j in range(v_dim):
            v[t, j] = row[v_off + j]
        x = a[first + t, h] + dt_bias[h]
        g[t] = A[h] * (x if x > 20.0 else math.log1p(math.exp(x)))
        beta[t] = 1.0 / (1.0 + math.exp(-b[first + t, h]))


@njit(inline="always", **JIT)
def _recurrent_step(q, k, v, g, beta, S, o):  # type: ignore[no-untyped-def]
    """S <- exp(g) S + k (beta (v - (exp(g) S)^T k))^T; o = S^T q."""
    k_dim, v_dim = S.shape
    decay = math.exp(g)
    predicted = np.zeros(v_dim, np.float32)
    for i in range(k_dim):
        for j in range(v_dim):
            S[i, j] *= decay
            predicted[j] += S[i, j] * k[i]
    for j in range(v_dim):
        predicted[j] = beta * (v[j] - predicted[j])  # now the delta written
        o[j] = 0.0
    for i in range(k_dim):
        for j in range(v_dim):
            S[i, j] += k[i] * predicted[j]
            o[j] += S[i, j] * q[i]


@njit(inline="always", **JIT)
def _chunk(q, k, v, g, beta, S, o):  # type: ignore[no-untyped-def]
    """One chunk of L tokens in the WY form (see the reference's delta_rule_chunked)."""
    L, k_dim = q.shape
    v_dim = v.shape[1]
    G = np.empty(L, np.float32)
    acc = 0.0
    for i in range(L):
        acc += g[i]
        G[i] = acc
    # U = (I + A)^-1 beta v and W = (I + A)^-1 beta exp(G) k by forward substitution, A strictly lower
    U = np.empty((L, v_dim), np.float32)
    W = np.empty((L, k_dim), np.float32)
    for i in range(L):
        for j in range(v_dim):
            U[i, j] = beta[i] * v[i, j]
        eg = beta[i] * math.exp(G[i])
        for d in range(k_dim):
            W[i, d] = eg * k[i, d]
        for m in range(i):
            kk = 0.0
            for d in range(k_dim):
                kk += k[i, d] * k[m, d]
            coef = beta[i] * kk * math.exp(G[i] - G[m])
            for j in range(v_dim):
                U[i, j] -= coef * U[m, j]
            for d in range(k_dim):
                W[i, d] -= coef * W[m, d]
    # V' = U - W S (what the state before the chunk did not predict), then the outputs
    for i in range(L):
        for d in range(k_dim):
            wd = W[i, d]
            for j in range(v_dim):
                U[i, j] -= wd * S[d, j]
    for i in range(L):
        eg = math.exp(G[i])
        for j in range(v_dim):
            o[i, j] = 0.0
        for d in range(k_dim):
            qd = q[i, d] * eg
            for j in range(v_dim):
                o[i, j] += qd * S[d, j]
        for m in range(i + 1):
            qk = 0.0
            for d in range(k_dim):
                qk += q[i, d] * k[m, d]
            coef = qk * math.exp(G[i] - G[m])
            for j in range(v_dim):
                o[i, j] += coef * U[m, j]
    # S <- exp(G_L) S + sum_m exp(G_L - G_m) k_m V'_m^T
    last = G[L - 1]
    decay = math.exp(last)
    for d in range(k_dim):
        for j in range(v_dim):
            S[d, j] *= decay
    for m in range(L):
        em = math.exp(last - G[m])
        for d in range(k_dim):
            kd = k[m, d] * em
            for j in range(v_dim):
                S[d, j] += kd * U[m, j]


def _conv1d_silu(x, w, states, starts, slots, positions, out):  # type: ignore[no-untyped-def]
    n_seqs, channels, taps = len(slots), x.shape[1], w.shape[1]
    blocks = (channels + _CONV_CHANNELS - 1) // _CONV_CHANNELS
    for task in prange(n_seqs * blocks):
        s, c0 = task // blocks, (task % blocks) * _CONV_CHANNELS
        c1 = min(channels, c0 + _CONV_CHANNELS)
        window = states[slots[s]]  # [taps - 1, channels]: the inputs before this run, oldest first
        if positions[starts[s]] == 0:
            window[:, c0:c1] = 0.0
        for t in range(starts[s], starts[s + 1]):
            for c in range(c0, c1):
                acc = w[c, taps - 1] * x[t, c]
                for j in range(taps - 1):
                    acc += w[c, j] * window[j, c]
                out[t, c] = acc / (1.0 + math.exp(-acc))
            for j in range(taps - 2):
                for c in range(c0, c1):
                    window[j, c] = window[j + 1, c]
            for c in range(c0, c1):
                window[taps - 2, c] = x[t, c]


_CONV1D = Twin(_conv1d_silu, min_work=1 << 14)


def causal_conv1d(x: np.ndarray, w: np.ndarray, states: np.ndarray, starts: np.ndarray, slots: np.ndarray,
                  positions: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _CONV1D.pick(x.size * w.shape[1])(x, w, states, starts, slots, positions, out)
    return out


def _gated_delta_net(qkv, a, b, A, dt_bias, states, starts, slots, positions, k_heads, k_dim, tiled, out):  # type: ignore[no-untyped-def]
    n_seqs, v_heads, v_dim = len(slots), out.shape[1], out.shape[2]
    per_key = v_heads // k_heads
    for task in prange(n_seqs * v_heads):
        s, h = task // v_heads, task % v_heads
        kh = h % k_heads if tiled else h // per_key
        first, last = starts[s], starts[s + 1]
        S = states[slots[s], h]  # [k_dim, v_dim]
        if positions[first] == 0:
            S[:, :] = 0.0
        n = last - first
        q = np.empty((n, k_dim), np.float32)
        k = np.empty((n, k_dim), np.float32)
        v = np.empty((n, v_dim), np.float32)
        g = np.empty(n, np.float32)
        beta = np.empty(n, np.float32)
        _head_inputs(qkv, a, b, A, dt_bias, first, n, h, kh, k_heads, k_dim, v_dim, q, k, v, g, beta)
        o = out[first:last, h]
        if n == 1:
            _recurrent_step(q[0], k[0], v[0], g[0], beta[0], S, o[0])
        else:
            for c in range(0, n, CHUNK):
                e = min(n, c + CHUNK)
                _chunk(q[c:e], k[c:e], v[c:e], g[c:e], beta[c:e], S, o[c:e])


_DELTA_NET = Twin(_gated_delta_net, min_work=1 << 14)


def gated_delta_net(qkv: np.ndarray, a: np.ndarray, b: np.ndarray, A: np.ndarray, dt_bias: np.ndarray,
                    states: np.ndarray, starts: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                    k_heads: int, k_dim: int, tiled: bool) -> np.ndarray:
    n, v_heads = a.shape
    v_dim = states.shape[3]
    out = np.empty((n, v_heads, v_dim), np.float32)
    _DELTA_NET.pick(n * v_heads * k_dim * v_dim)(
        np.ascontiguousarray(qkv, np.float32), np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32),
        A, dt_bias, states, starts, slots, positions, k_heads, k_dim, tiled, out)
    return out
