"""CudaOps: the ops API on an NVIDIA GPU (or numba's CUDA simulator), numba.cuda kernels over
DeviceArrays.

Weights go to the device once, at load, in their file formats; activations stay there between ops;
a step's metadata arrives through to_device once (ModelRunner.prepare) and every layer reads it
there. Only what the caller asks for comes back: token ids (and logprobs) from argmax_rows and
sample_rows, which run the whole sampler on the device, and logits rows through to_numpy.

Every row is computed in float32, prompt or generated: decode_rows (the CPU's quantized-activation
decode) is accepted and not used, so a GPU step's numerics never depend on the batch's makeup.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from numba import cuda

from ember.kernels.cuda import dense, quant_matmul, sampling
from ember.kernels.cuda.device import device_scope
from ember.kernels.cuda.device_array import DeviceArray, zeros
from ember.kernels.cuda.paged_attention import CudaKVStore, kv_write, paged_attention
from ember.kernels.cuda.quant_matmul import CudaWeight, Tables
from ember.kernels.cuda.experts import expert_ffn as experts_ffn
from ember.kernels.ops import Array, ExpertWeights, Ops
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference.quant import dequantize
from ember.kernels.sampling import Choice
from ember.kernels.sampling_batch import SamplingBatch


class CudaOps(Ops):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.index = index
        with self.device_scope():
            self.tables = Tables.upload()

    def device_scope(self) -> AbstractContextManager[Any]:
        return device_scope(self.index)

    # --- placing weights ------------------------------------------------------------------------
    def weight(self, t: RawTensor) -> CudaWeight:
        return quant_matmul.upload(t)

    def vector(self, t: RawTensor) -> DeviceArray:
        host = np.ascontiguousarray(dequantize(t.ttype, t.rows2d(), t.cols).reshape(-1))  # small: norms, biases
        return DeviceArray(cuda.to_device(host))

    def weight_rows(self, w: CudaWeight) -> int:
        return w.rows

    # --- kernels --------------------------------------------------------------------------------
    def matmul(self, x: Array, w: CudaWeight, decode_rows: Array | None = None) -> DeviceArray:
        return quant_matmul.matmul(x, w, self.tables)

    def expert_ffn(self, x: Array, experts: Mapping[int, ExpertWeights], token: np.ndarray, expert: np.ndarray,
                   weight: np.ndarray, decode_rows: Array | None = None) -> DeviceArray:
        return experts_ffn(self, x, experts, np.asarray(token), np.asarray(expert), np.asarray(weight), decode_rows)

    def embedding(self, w: CudaWeight, ids: Array) -> DeviceArray:
        return quant_matmul.embedding(w, self._on_device(ids, np.int64), self.tables)

    def rmsnorm(self, x: Array, w: Array, eps: float) -> DeviceArray:
        return dense.rmsnorm(x, w, eps)

    def rope(self, x: Array, positions: Array, inv_freq: Array, interleaved: bool) -> DeviceArray:
        return dense.rope(x, self._on_device(positions, np.int64), inv_freq, interleaved)

    def kv_store(self, dtype: str, n_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 keys: bool) -> CudaKVStore:
        return CudaKVStore.allocate(dtype, n_blocks, block_size, kv_heads, head_dim)  # one layout for K and V

    def kv_write(self, store: CudaKVStore, blocks: Array, offsets: Array, rows: Array) -> None:
        kv_write(store, self._on_device(blocks, np.int64), self._on_device(offsets, np.int64), rows)

    def paged_attention(self, q: Array, k: CudaKVStore, v: CudaKVStore, tables: Array, token_seq: Array,
                        positions: Array, scale: float, window: int = 0) -> DeviceArray:
        return paged_attention(q, k, v, self._on_device(tables, np.int32), self._on_device(token_seq, np.int32),
                               self._on_device(positions, np.int64), scale, self.tables, window)

    def swiglu(self, gate: Array, up: Array) -> DeviceArray:
        return dense.swiglu(gate, up)

    def sigmoid_mul(self, x: Array, gate: Array) -> DeviceArray:
        return dense.sigmoid_mul(x, gate)

    def softmax(self, x: Array) -> DeviceArray:
        return dense.softmax(x)

    def argmax_rows(self, x: Array, rows: Array) -> DeviceArray:
        return dense.argmax_rows(x, self._on_device(rows, np.int64))

    def sample_rows(self, logits: Array, batch: SamplingBatch) -> list[Choice | str]:
        return sampling.sample_rows(logits, batch)

    # --- moving data ----------------------------------------------------------------------------
    def to_device(self, x: np.ndarray) -> DeviceArray:
        return DeviceArray(cuda.to_device(np.ascontiguousarray(x)))

    def zeros(self, shape: tuple[int, ...]) -> DeviceArray:
        return zeros(shape)

    def to_numpy(self, x: Array) -> np.ndarray:
        return x.to_host() if isinstance(x, DeviceArray) else np.asarray(x)

    def _on_device(self, x: Array, dtype: type) -> DeviceArray:
        """Metadata where the kernels read it: StepBatch arrays already are (prepare moved them);
        host arrays (direct callers, tests) are uploaded."""
        return x if isinstance(x, DeviceArray) else self.to_device(np.asarray(x, dtype))
