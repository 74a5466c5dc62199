"""RawTensor: a tensor as a model file stores it, before any backend touches it.

Loaders (GGUF, safetensors) produce RawTensors whose `data` is a zero-copy view of the mmap'd file;
backends turn them into whatever layout their kernels want. Shapes are numpy order: a 2-D weight is
[rows (output features), cols (input features)], each row contiguous.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.kernels.tensor_types import TensorType, row_bytes


@dataclass(frozen=True)
class RawTensor:
    name: str
    ttype: TensorType
    shape: tuple[int, ...]
    # F32: float32 array of `shape`; F16/BF16: uint16 array of `shape`; quantized: uint8 array of
    # shape[:-1] + (row_bytes,)
    data: np.ndarray

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.rows * row_bytes(self.ttype, self.cols)

    def rows2d(self) -> np.ndarray:
        """The storage as a 2-D array [rows, row storage] (no copy)."""
        return self.data.reshape(self.rows, -1)
