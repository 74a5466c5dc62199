"""GatedDeltaNet: the linear-attention token mixer of hybrid models (qwen35), written against the ops API.

In projections give the q/k/v channels (through a causal conv1d), the output gate z, and per value
head the decay input a and the write strength b; the gated delta rule updates each sequence's state
and reads it; a gated RMSNorm (rmsnorm(o) * silu(z)) and the out projection follow. The state lives in
the cache (models/recurrent_state.py) at the sequence's slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.ops import Array, Ops, Weight
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import TensorType


@dataclass
class GatedDeltaNet:
    index: int  # which linear-attention layer: its state in cache.state
    qkv: Weight
    z: Weight
    a: Weight
    b: Weight
    conv: Array  # [C, K]
    A: Array  # [v_heads], negative: the decay rate (log space)
    dt_bias: Array  # [v_heads]
    norm: Array  # [v_dim]
    out: Weight
    tiled: bool  # value heads in llama.cpp's tiled order (GGUF) rather than grouped by key head (HF)

    def __call__(self, ops: Ops, cfg: ModelConfig, x: Array, cache: PagedKVCache, batch: StepBatch) -> Array:
        lin, n, rows = cfg.linear, x.shape[0], batch.decode_rows
        qkv, z, a, b = ops.matmul_many(x, (self.qkv, self.z, self.a, self.b), rows)
        state = cache.state
        mixed = ops.causal_conv1d(qkv, self.conv, state.conv[self.index], batch.seq_starts, batch.state_slots,
                                  batch.positions)
        o = ops.gated_delta_net(mixed, a, b, self.A, self.dt_bias, state.delta[self.index], batch.seq_starts,
                                batch.state_slots, batch.positions, lin.k_heads, lin.k_dim, self.tiled)
        o = ops.swiglu(z.reshape(n, lin.v_heads, lin.v_dim), ops.rmsnorm(o, self.norm, cfg.norm_eps))
        return ops.matmul(o.reshape(n, lin.v_heads * lin.v_dim), self.out, rows)


def load_gated_delta_net(mf: ModelFile, ops: Ops, layer: int, index: int) -> GatedDeltaNet:
    """Layer `layer`'s tensors under llama.cpp's names. A GGUF file holds them as llama.cpp's converter
    wrote them (ssm_a = -exp(A_log), value heads tiled); an HF directory as trained (A_log, grouped)."""
    lin = mf.config.linear

    def w(name: str) -> Weight:
        return ops.weight(mf.tensor(f"blk.{layer}.{name}.weight"))

    def vec(name: str) -> Array:
        return ops.vector(mf.tensor(f"blk.{layer}.{name}"))

    a_raw = ops.to_numpy(vec("ssm_a"))
    A = -np.exp(a_raw) if mf.format == "hf" else a_raw
    conv = ops.to_numpy(vec("ssm_conv1d.weight")).reshape(lin.conv_channels, lin.conv_kernel)
    return GatedDeltaNet(
        index=index, qkv=w("attn_qkv"), z=w("attn_gate"), a=w("ssm_alpha"), b=w("ssm_beta"),
        conv=_f32(ops, f"blk.{layer}.ssm_conv1d", conv), A=_f32(ops, f"blk.{layer}.ssm_a", A),
        dt_bias=vec("ssm_dt.bias"), norm=vec("ssm_norm.weight"), out=w("ssm_out"), tiled=mf.format == "gguf",
    )


def _f32(ops: Ops, name: str, values: np.ndarray) -> Array:
    """A host array computed at load, on the device (ops.vector of a float32 tensor keeps its shape)."""
    values = np.ascontiguousarray(values, np.float32)
    return ops.vector(RawTensor(name, TensorType.F32, values.shape, values)).reshape(values.shape)
