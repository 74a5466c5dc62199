"""CpuOps: the ops API on the CPU, numba kernels over numpy arrays."""
from __future__ import annotations

import numpy as np

from ember.kernels.cpu import dense, quant_matmul
from ember.kernels.ops import Array, Ops
from ember.kernels.quant_reference import dequantize
from ember.kernels.raw_tensor import RawTensor


class CpuOps(Ops):
    name = "cpu"

    def weight(self, t: RawTensor) -> quant_matmul.CpuWeight:
        return quant_matmul.pack(t)

    def vector(self, t: RawTensor) -> np.ndarray:
        return np.ascontiguousarray(dequantize(t.ttype, t.rows2d(), t.cols).reshape(-1))

    def weight_rows(self, w: quant_matmul.CpuWeight) -> int:
        return w.rows

    def matmul(self, x: Array, w: quant_matmul.CpuWeight) -> np.ndarray:
        return quant_matmul.matmul(np.ascontiguousarray(x, dtype=np.float32), w)

    def embedding(self, w: quant_matmul.CpuWeight, ids: np.ndarray) -> np.ndarray:
        return quant_matmul.embedding(w, np.asarray(ids, dtype=np.int64))

    def rmsnorm(self, x: Array, w: Array, eps: float) -> np.ndarray:
        return dense.rmsnorm(x, w, eps)

    def rope(self, x: Array, positions: np.ndarray, inv_freq: Array, interleaved: bool) -> np.ndarray:
        return dense.rope(x, positions, inv_freq, interleaved)

    def attention(self, q: Array, k: Array, v: Array, start: int, scale: float) -> np.ndarray:
        return dense.attention(q, k, v, start, scale)

    def swiglu(self, gate: Array, up: Array) -> np.ndarray:
        return dense.swiglu(gate, up)

    def softmax(self, x: Array) -> np.ndarray:
        return dense.softmax(x)

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.asarray(x)
