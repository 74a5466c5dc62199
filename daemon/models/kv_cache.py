"""PagedKVCache: the device memory of the KV cache — per attention layer, a K and a V store of
fixed-size blocks in the policy's dtype — and, for hybrid models, the recurrent state of their
linear-attention layers beside it. Which block belongs to whom is the BlockManager's business
(block_manager.py).

Sliding-window layers may keep only their window (`ring` > 0): each running sequence's state slot
(Sequence.state_slot) owns `ring` blocks of those layers' stores, which its positions take in turn
(logical block b in block b % ring of the slot's run). A ring of ceil((window - 1 + step) / block)
blocks, `step` the most positions a sequence runs in one step, holds every key a step reads even
after that step's writes (step/window_ring.py). Their memory then stays flat however long the
sequences grow; the full layers' blocks grow with them, as the BlockManager hands them out.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ember.daemon.models.recurrent_state import RecurrentState
from ember.kernels.convert import storage_bytes
from ember.kernels.ops import Array, Ops


class PagedKVCache:
    def __init__(self, ops: Ops, n_layers: int, kv_heads: int, head_dim: int, n_blocks: int,
                 block_size: int = 16, dtype: str = "f32", state: RecurrentState | None = None,
                 shapes: Sequence[tuple[int, int]] | None = None, windowed: Sequence[bool] = (), ring: int = 0,
                 slots: int = 0) -> None:
        """n_layers layers of [kv_heads, head_dim] rows, or per layer its own (kv_heads, head_dim)
        where `shapes` gives them (gemma4's full layers); with `ring` > 0, the layers `windowed`
        marks hold `ring` blocks for each of `slots` state slots instead of n_blocks."""
        self.ops, self.n_blocks, self.block_size, self.dtype = ops, n_blocks, block_size, dtype
        self.state = state
        self.shapes = list(shapes or [(kv_heads, head_dim)] * n_layers)
        self.ring = ring if any(windowed) else 0
        self.windowed = [bool(w) and self.ring > 0 for w in windowed] or [False] * n_layers
        sizes = [slots * ring if w else n_blocks for w in self.windowed]
        self.k = [ops.kv_store(dtype, b, block_size, h, d, keys=True) for b, (h, d) in zip(sizes, self.shapes, strict=True)]
        self.v = [ops.kv_store(dtype, b, block_size, h, d, keys=False) for b, (h, d) in zip(sizes, self.shapes, strict=True)]
        self.layer_bytes = [2 * b * block_size * h * storage_bytes(dtype, d)
                            for b, (h, d) in zip(sizes, self.shapes, strict=True)]

    def bytes_of(self, windowed: bool) -> int:
        """Bytes held by the window layers' rings (True) or by the layers paged over every position."""
        return sum(b for b, w in zip(self.layer_bytes, self.windowed, strict=True) if w == windowed)

    def ring_tables(self, slots: np.ndarray, width: int) -> np.ndarray:
        """The window layers' block tables [sequences, width] (host): slot s's logical block b is
        its ring's block b % ring."""
        return (slots[:, None] * self.ring + np.arange(width) % self.ring).astype(np.int32)

    def write(self, layer: int, blocks: Array, offsets: Array, k: Array, v: Array) -> None:
        """Store k, v [n, kv_heads, head_dim] at row offsets[i] of block blocks[i]."""
        self.ops.kv_write(self.k[layer], blocks, offsets, k)
        self.ops.kv_write(self.v[layer], blocks, offsets, v)
