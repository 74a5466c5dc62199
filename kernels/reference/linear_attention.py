"""Plain numpy references of the linear-attention (Gated DeltaNet) kernels: the oracle the backends are
tested against, written from the papers' equations, in float64, for clarity.

Gated DeltaNet (Yang et al., "Gated Delta Networks", 2024), per value head, with a state S [k_dim, v_dim]:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T      (decay, then a delta-rule write)
    o_t = S_t^T q_t

q and k are L2-normalised per head and q is scaled by k_dim^-1/2 first. The chunked form (the "WY"
representation of DeltaNet, Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule")
gives the same outputs and final state with matrix products over chunks of tokens instead of a loop.
The causal conv1d (Mamba's short convolution) runs each channel over its last `kernel` inputs, the
state being the previous kernel-1 inputs.
"""
from __future__ import annotations

import numpy as np


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def causal_conv1d(x: np.ndarray, w: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """silu of the depthwise causal convolution of x [n, C] by w [C, K], continuing from state
    [K-1, C] (the inputs before x, oldest first). Returns (out [n, C], the new state)."""
    k = w.shape[1]
    window = np.concatenate([state.astype(np.float64), x.astype(np.float64)])  # [K-1+n, C]
    out = np.stack([(window[t : t + k] * w.T.astype(np.float64)).sum(axis=0) for t in range(len(x))])
    return silu(out).astype(np.float32), window[len(window) - (k - 1):].astype(np.float32)


def gates(a: np.ndarray, b: np.ndarray, A: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The decay g = A * softplus(a + dt_bias) (A < 0: log-space, g <= 0) and the write strength
    beta = sigmoid(b), per token and value head."""
    x = a.astype(np.float64) + dt_bias
    softplus = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return A * softplus, 1.0 / (1.0 + np.exp(-b.astype(np.float64)))


def expand_heads(x: np.ndarray, v_heads: int, tiled: bool) -> np.ndarray:
    """Key heads [n, hk, d] -> one per value head [n, hv, d]. Value head j uses key head j // (hv/hk)
    when grouped (the Hugging Face order), j % hk when tiled (llama.cpp's GGUF order)."""
    hk = x.shape[1]
    idx = np.arange(v_heads) % hk if tiled else np.arange(v_heads) // (v_heads // hk)
    return x[:, idx]


def normalize_qk(q: np.ndarray, k: np.ndarray, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    q64 = q64 / np.sqrt((q64 * q64).sum(-1, keepdims=True) + eps)
    k64 = k64 / np.sqrt((k64 * k64).sum(-1, keepdims=True) + eps)
    return q64 * q.shape[-1] ** -0.5, k64


def delta_rule_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token by token. q, k [n, h, dk] (normalised, q scaled), v [n, h, dv], g, beta [n, h], state
    [h, dk, dv]. Returns (out [n, h, dv], the new state)."""
    S = state.astype(np.float64).copy()
    out = np.empty(v.shape, np.float64)
    for t in range(len(q)):
        S *= np.exp(g[t])[:, None, None]
        predicted = np.einsum("hkv,hk->hv", S, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        S += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out.astype(np.float32), S.astype(np.float32)


def delta_rule_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       state: np.ndarray, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The same map in chunks of `chunk` tokens. Inside a chunk with cumulative decay G_i = g_1 + .. + g_i:

        A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) for j < i        (strictly lower triangular)
        (I + A) U = beta v,  (I + A) W = beta exp(G) k               (forward substitution)
        V' = U - W S                                                 (what the old state did not predict)
        o_i = exp(G_i) q_i^T S + sum_{j <= i} (q_i . k_j) exp(G_i - G_j) V'_j
        S  <- exp(G_L) S + sum_j exp(G_L - G_j) k_j V'_j^T
    """
    S = state.astype(np.float64).copy()
    out = np.empty(v.shape, np.float64)
    for c in range(0, len(q), chunk):
        sl = slice(c, min(c + chunk, len(q)))
        for h in range(q.shape[1]):
            out[sl, h], S[h] = _chunk(q[sl, h], k[sl, h], v[sl, h].astype(np.float64), g[sl, h], beta[sl, h], S[h])
    return out.astype(np.float32), S.astype(np.float32)


def _chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
           S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    G = np.cumsum(g)
    decay = np.exp(np.tril(G[:, None] - G[None, :]))  # [i, j]: exp(G_i - G_j) on and below the diagonal
    A = np.tril(beta[:, None] * (k @ k.T) * decay, -1)
    T = np.linalg.inv(np.eye(len(q)) + A)
    U = T @ (beta[:, None] * v)
    W = T @ (beta[:, None] * np.exp(G)[:, None] * k)
    V = U - W @ S
    out = np.exp(G)[:, None] * (q @ S) + np.tril((q @ k.T) * decay) @ V
    S = np.exp(G[-1]) * S + (np.exp(G[-1] - G)[:, None] * k).T @ V
    return out, S
