"""A plain numpy DFlash draft, written from llama.cpp's src/models/dflash.cpp (graph<false>): the
oracle of daemon/models/dflash.py beside llama.cpp itself. Weights are float32 arrays [out, in] (the
GGUF's, dequantized), computed in float64 where dense.py's references do.

  inject: g = rmsnorm(features @ fc.T) * enc_norm; per layer K = rope(rmsnorm_head(g @ wk.T) * k_norm),
          V = g @ wv.T (no attention norm: the embd batch goes straight to wk/wv)
  block:  x = embed[ids]; per layer h = rmsnorm(x) * attn_norm, q/k/v = h @ w.T, q/k head norms, rope
          (NeoX halves), attention of every block token over the injected context and the WHOLE
          block (non-causal), x += o @ wo.T; x += down(silu(gate h') * up h') with h' = rmsnorm(x) *
          ffn_norm; logits = (rmsnorm(x) * out_norm) @ output.T
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.kernels.reference.dense import attention, rmsnorm, rope, swiglu


@dataclass(frozen=True)
class Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    ffn_norm: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass(frozen=True)
class Draft:
    fc: np.ndarray
    enc_norm: np.ndarray
    layers: list[Layer]
    norm: np.ndarray
    embed: np.ndarray  # [vocab, hidden]
    output: np.ndarray  # [vocab, hidden]
    heads: int
    kv_heads: int
    head_dim: int
    inv_freq: np.ndarray
    eps: float


def inject(d: Draft, features: np.ndarray, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, the (K, V) [n, kv_heads, head_dim] the features put in the draft's cache."""
    g = rmsnorm(_mm(features, d.fc), d.enc_norm, d.eps)
    out = []
    for layer in d.layers:
        k = rmsnorm(_mm(g, layer.wk).reshape(len(g), d.kv_heads, d.head_dim), layer.k_norm, d.eps)
        out.append((rope(k, positions, d.inv_freq, False), _mm(g, layer.wv).reshape(len(g), d.kv_heads, d.head_dim)))
    return out


def block_logits(d: Draft, ids: np.ndarray, start: int, context: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Logits [len(ids), vocab] of the noise block `ids` at positions start.., over the injected
    `context` (inject()'s output for positions 0..start-1)."""
    n = len(ids)
    positions = np.arange(start, start + n)
    x = d.embed[ids].astype(np.float32)
    for layer, (ck, cv) in zip(d.layers, context, strict=True):
        h = rmsnorm(x, layer.attn_norm, d.eps)
        q = rmsnorm(_mm(h, layer.wq).reshape(n, d.heads, d.head_dim), layer.q_norm, d.eps)
        k = rmsnorm(_mm(h, layer.wk).reshape(n, d.kv_heads, d.head_dim), layer.k_norm, d.eps)
        v = _mm(h, layer.wv).reshape(n, d.kv_heads, d.head_dim)
        q, k = rope(q, positions, d.inv_freq, False), rope(k, positions, d.inv_freq, False)
        keys = np.concatenate([ck, k]).transpose(1, 0, 2)  # [kv_heads, start + n, hd]
        values = np.concatenate([cv, v]).transpose(1, 0, 2)
        # `start` past the last key: every block token sees every key (not causal)
        o = attention(q, keys, values, start + n, d.head_dim**-0.5).reshape(n, d.heads * d.head_dim)
        x = x + _mm(o, layer.wo)
        h = rmsnorm(x, layer.ffn_norm, d.eps)
        x = x + _mm(swiglu(_mm(h, layer.gate), _mm(h, layer.up)), layer.down)
    return _mm(rmsnorm(x, d.norm, d.eps), d.output)


def _mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
