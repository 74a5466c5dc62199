"""FeatureMirror: the target's captured hidden states of every context position, per sequence, for a
feature-conditioned (DFlash) draft — paged like the KV cache and addressed by the same block tables.

A row is len(target_layers) x hidden values, stored as f32, f16, bf16 or q8_0 (the precision policy's
`feature` dtype: EMBER_FEATURE_DTYPE, the per-model `feature_dtype` key) through kernels/convert.py's
ggml-exact conversions, and converted back to f32 where the draft reads it. Its bytes are exactly
n_blocks x block_size x storage_bytes(dtype, width), which is what the memory planner counts
(planner._feature_mirror). Shared block tables make prefix reuse and preemption carry it as they
carry the KV cache: a reused block brings its rows, in their stored dtype, with nothing to copy.
"""
from __future__ import annotations

import numpy as np

from ember.kernels.convert import STORAGE_DTYPES, decode_rows, encode_rows, storage_bytes

_VIEW = {"f32": np.float32, "f16": np.uint16, "bf16": np.uint16, "q8_0": np.uint8}  # convert.py's layouts


class FeatureMirror:
    def __init__(self, n_blocks: int, block_size: int, width: int, dtype: str = "f32") -> None:
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"unknown feature dtype {dtype!r} (choose from {', '.join(STORAGE_DTYPES)})")
        self.n_blocks, self.block_size, self.width, self.dtype = n_blocks, block_size, width, dtype
        self.row_bytes = storage_bytes(dtype, width)
        self.store = np.zeros((n_blocks, block_size, self.row_bytes), np.uint8)

    @property
    def nbytes(self) -> int:
        return int(self.store.nbytes)

    def write(self, blocks: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> None:
        """Store float32 rows [n, width] at (blocks[i], offsets[i]), converted to the mirror's dtype."""
        self.store[blocks, offsets] = encode_rows(rows, self.dtype).view(np.uint8)

    def read(self, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The rows at (blocks[i], offsets[i]) as float32 [n, width]."""
        return decode_rows(self.store[blocks, offsets].view(_VIEW[self.dtype]), self.dtype, self.width)
