"""PagedKVCache: the device memory of the KV cache — per attention layer, a K and a V store of
fixed-size blocks in the policy's dtype — and, for hybrid models, the recurrent state of their
linear-attention layers beside it. Which block belongs to whom is the BlockManager's business
(block_manager.py).
"""
from __future__ import annotations

from ember.daemon.models.recurrent_state import RecurrentState
from ember.kernels.ops import Array, Ops


class PagedKVCache:
    def __init__(self, ops: Ops, n_layers: int, kv_heads: int, head_dim: int, n_blocks: int,
                 block_size: int = 16, dtype: str = "f32", state: RecurrentState | None = None,
                 shapes: list[tuple[int, int]] | None = None) -> None:
        """n_layers layers of [kv_heads, head_dim] rows, or per layer its own (kv_heads, head_dim)
        where `shapes` gives them (gemma4's full layers)."""
        self.ops, self.n_blocks, self.block_size, self.dtype = ops, n_blocks, block_size, dtype
        self.state = state
        self.shapes = shapes or [(kv_heads, head_dim)] * n_layers
        self.k = [ops.kv_store(dtype, n_blocks, block_size, h, d) for h, d in self.shapes]
        self.v = [ops.kv_store(dtype, n_blocks, block_size, h, d) for h, d in self.shapes]

    def write(self, layer: int, blocks: Array, offsets: Array, k: Array, v: Array) -> None:
        """Store k, v [n, kv_heads, head_dim] at row offsets[i] of block blocks[i]."""
        self.ops.kv_write(self.k[layer], blocks, offsets, k)
        self.ops.kv_write(self.v[layer], blocks, offsets, v)
