"""RecurrentState: the device memory of a hybrid model's linear-attention layers — per layer, each
sequence slot's conv window [K-1, C] and DeltaNet state [v_heads, k_dim, v_dim], float32.

Beside the paged KV cache of the full-attention layers, and unlike it, fixed per sequence: a slot
holds the whole past of a sequence, however long. Which sequence owns which slot is the scheduler's
business (a running sequence holds one); a run starting at position 0 resets its slot (ops API).
"""
from __future__ import annotations

from ember.daemon.loader.model_config import LinearAttention
from ember.kernels.ops import Array, Ops


class RecurrentState:
    def __init__(self, ops: Ops, linear: LinearAttention, slots: int) -> None:
        self.slots = slots
        c = linear
        self.conv: list[Array] = [ops.zeros((slots, c.conv_kernel - 1, c.conv_channels)) for _ in range(c.n_layers)]
        self.delta: list[Array] = [ops.zeros((slots, c.v_heads, c.k_dim, c.v_dim)) for _ in range(c.n_layers)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv + self.delta)
