"""KVCache: keys and values of one sequence, per layer, as contiguous [kv_heads, capacity, head_dim]
float32 arrays on the model's device. (The paged, multi-sequence cache of the scheduler replaces it.)
"""
from __future__ import annotations

from ember.kernels.ops import Array, Ops


class KVCache:
    def __init__(self, ops: Ops, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int) -> None:
        self.capacity = capacity
        self.k = [ops.zeros((n_kv_heads, capacity, head_dim)) for _ in range(n_layers)]
        self.v = [ops.zeros((n_kv_heads, capacity, head_dim)) for _ in range(n_layers)]

    def write(self, layer: int, start: int, k: Array, v: Array) -> None:
        """Store k, v [n, kv_heads, head_dim] at positions start .. start + n."""
        n = k.shape[0]
        if start + n > self.capacity:
            raise ValueError(f"KV cache full: {start + n} positions > capacity {self.capacity}")
        self.k[layer][:, start : start + n] = k.transpose(1, 0, 2)
        self.v[layer][:, start : start + n] = v.transpose(1, 0, 2)
