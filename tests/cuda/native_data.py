"""Test data for the native kernels: weights of every type as a GGUF file stores them, with random
quants and sane scales, and a paged KV store's contents decoded back to floats."""
from __future__ import annotations

import numpy as np

from ember.kernels.convert import bf16_bits_to_f32, f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits
from ember.kernels.tensor_types import BLOCK_GEOMETRY, TensorType


def random_weight(ttype: TensorType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols] in the file's storage: random bits everywhere but the f16 block scales, which are
    small and finite (any bits are a valid block otherwise)."""
    if ttype in (TensorType.F16, TensorType.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.05)
        return f32_to_f16_bits(values) if ttype == TensorType.F16 else f32_to_bf16_bits(values)
    values, size = BLOCK_GEOMETRY[ttype]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    scale_fields = (208,) if ttype == TensorType.Q6_K else (0, 2) if ttype in (TensorType.Q4_K, TensorType.Q5_K) else (0,)
    for at in scale_fields:
        d = rng.uniform(-0.01, 0.01, blocks.shape[:2]).astype(np.float32)
        blocks[..., at:at + 2] = f32_to_f16_bits(d).view(np.uint8).reshape(blocks.shape[:2] + (2,))
    return blocks.reshape(rows, -1)


def decode_kv(dtype: str, data: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of a KV store's data [.., head_dim]."""
    if dtype == "f32":
        return data.astype(np.float32)
    if dtype == "f16":
        return f16_bits_to_f32(data)
    if dtype == "bf16":
        return bf16_bits_to_f32(data)
    d = f16_bits_to_f32(scales)[..., :, None]
    return (data.reshape(data.shape[:-1] + (-1, 32)).astype(np.float32) * d).reshape(data.shape)
