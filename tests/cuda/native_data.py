"""Test data for the native kernels: weights of every type as a GGUF file stores them, with random
quants and sane scales; paged KV stores filled at random and decoded back to floats; and the numpy
reference of paged attention over them."""
from __future__ import annotations

import numpy as np

from ember.kernels.convert import (bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits,
                                   quantize_q8_0_split)
from ember.kernels.tensor_types import BLOCK_GEOMETRY, TensorType
from ember.kernels.cuda.native_launch import NativeKv


def random_weight(ttype: TensorType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols] in the file's storage: random bits everywhere but the f16 block scales, which are
    small and finite (any bits are a valid block otherwise)."""
    if ttype in (TensorType.F16, TensorType.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.05)
        return f32_to_f16_bits(values) if ttype == TensorType.F16 else f32_to_bf16_bits(values)
    values, size = BLOCK_GEOMETRY[ttype]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    k_quant = ttype in (TensorType.Q4_K, TensorType.Q5_K)
    scale_fields = (208,) if ttype == TensorType.Q6_K else (0, 2) if k_quant else (0,)
    for at in scale_fields:
        d = rng.uniform(-0.01, 0.01, blocks.shape[:2]).astype(np.float32)
        blocks[..., at:at + 2] = f32_to_f16_bits(d).view(np.uint8).reshape(blocks.shape[:2] + (2,))
    return blocks.reshape(rows, -1)


def decode_kv(dtype: str, data: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """float32 values of a KV store's data [.., head_dim]."""
    if dtype == "f32":
        return data.astype(np.float32)
    if dtype == "f16":
        return f16_bits_to_f32(data)
    if dtype == "bf16":
        return bf16_bits_to_f32(data)
    d = f16_bits_to_f32(scales)[..., :, None]
    return (data.reshape(data.shape[:-1] + (-1, 32)).astype(np.float32) * d).reshape(data.shape)


def random_store(dtype: str, n_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                  rng: np.random.Generator) -> NativeKv:
    store = NativeKv.allocate(np, dtype, n_blocks, block_size, kv_heads, head_dim)
    values = rng.standard_normal(store.data.shape).astype(np.float32)
    if dtype == "f32":
        store.data[...] = values
    elif dtype == "f16":
        store.data[...] = f32_to_f16_bits(values)
    elif dtype == "bf16":
        store.data[...] = f32_to_bf16_bits(values)
    else:
        scales, quants = quantize_q8_0_split(values)
        store.data[...], store.scales[...] = quants, scales
    return store


def reference_attention(q: np.ndarray, k: NativeKv, v: NativeKv, tables: np.ndarray, lengths: np.ndarray,
                         scale: float) -> np.ndarray:
    out = np.zeros(q.shape)
    keys, values = decode_kv(k.dtype, k.data, k.scales), decode_kv(v.dtype, v.data, v.scales)
    block_size, kv_heads = k.data.shape[1], k.data.shape[2]
    group = q.shape[1] // kv_heads
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        t = np.arange(length)
        blocks, offsets = tables[b, t // block_size], t % block_size
        for h in range(q.shape[1]):
            kk, vv = keys[blocks, offsets, h // group].astype(np.float64), values[blocks, offsets, h // group]
            s = kk @ q[b, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[b, h] = p @ vv / p.sum()
    return out
