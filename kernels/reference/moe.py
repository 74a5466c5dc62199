"""Plain numpy reference of a mixture-of-experts feed-forward (router softmax or sigmoid, top-k,
optional renormalisation, then the weighted sum of the chosen experts' gated FFNs), in float64: the
oracle for ops.route and ops.expert_ffn."""
from __future__ import annotations

import numpy as np


def route(logits: np.ndarray, k: int, normalize: bool, gating: str = "softmax", bias: np.ndarray | None = None,
          softcap: float = 0.0, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [n, k], weights [n, k]) as transformers' Qwen3MoE / Mixtral routers pick them
    (softmax), or Laguna's (sigmoid, a selection bias, soft-capped logits, scaled weights)."""
    z = logits.astype(np.float64)
    if softcap:
        z = softcap * np.tanh(z / softcap)
    if gating == "softmax":
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    else:
        p = 1 / (1 + np.exp(-z))
    ids = np.argsort(-(p if bias is None else p + bias), axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if normalize:
        w /= w.sum(axis=1, keepdims=True)
    return ids, w * scale


def moe_ffn(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, ids: np.ndarray,
            weights: np.ndarray) -> np.ndarray:
    """x [n, d]; gate, up [experts, f, d]; down [experts, d, f]; ids, weights [n, k] -> [n, d]."""
    x64 = x.astype(np.float64)
    out = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t], weights[t]):
            g, u = gate[e] @ x64[t], up[e] @ x64[t]
            out[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out
