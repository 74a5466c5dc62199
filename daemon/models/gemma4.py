"""Gemma 4's decoder layer and per-layer embedding (transformers' Gemma4TextDecoderLayer and
Gemma4TextModel.get_per_layer_inputs / project_per_layer_inputs), written against the ops API.

A Gemma 4 layer norms around its attention and its FFN on both sides ("sandwich" norms), its FFN is
GELU-tanh gated, and the MoE variant adds routed experts beside that FFN, not in its place (their
outputs normed apart, then summed). Small models add a per-layer embedding (PLE): each token brings,
besides its embedding, a narrow input for every layer, mixed from a second embedding table and a
projection of the first; each layer gates it with its hidden state and adds it back. Each layer
ends scaled by its own scalar.

Its attention is the shared Attention (transformer.py) with Gemma's options: unscaled scores (the q
and k norms scale), values RMS-normed, a full layer's own head_dim and KV heads, values from the keys'
projection (attention_k_eq_v), and the last layers reading an earlier layer's K/V (KV sharing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ember.daemon.experts.expert_manager import ExpertManager
from ember.daemon.experts.moe_ffn import MoEFFN, load_moe_ffn
from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.ops import Array, Ops, Weight
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import TensorType

if TYPE_CHECKING:  # transformer.py builds these blocks, importing this module
    from ember.daemon.models.transformer import Attention, DenseFFN


@dataclass
class LayerInput:
    """One layer's use of its per-layer input p [n, P]: h + norm(proj(gelu(gate h) * p))."""

    gate: Weight  # [P, hidden]
    proj: Weight  # [hidden, P]
    norm: Array

    def __call__(self, ops: Ops, cfg: ModelConfig, h: Array, p: Array, rows: Array, scale: float = 1.0) -> Array:
        """(h + this) * scale."""
        mixed = ops.geglu(ops.matmul(h, self.gate, rows), p)
        return ops.add_rmsnorm(h, ops.matmul(mixed, self.proj, rows), self.norm, cfg.norm_eps, scale)


@dataclass
class PerLayerEmbedding:
    """The per-layer inputs of a step's tokens, [n, layers, P]: (norm(proj(x) / sqrt(hidden)) +
    table[id] * sqrt(P)) / sqrt(2), x the scaled embedding the first layer reads."""

    table: Weight  # [vocab_per_layer, layers * P]
    proj: Weight  # [layers * P, hidden]
    norm: Array  # [P]

    def __call__(self, ops: Ops, cfg: ModelConfig, x: Array, ids: np.ndarray, rows: Array) -> Array:
        n, width = x.shape[0], cfg.layer_input_dim
        mixed = ops.rmsnorm((ops.matmul(x, self.proj, rows) * cfg.hidden**-0.5).reshape(n, cfg.n_layers, width),
                            self.norm, cfg.norm_eps)
        own = ops.embedding(self.table, ids).reshape(n, cfg.n_layers, width) * width**0.5
        return (mixed + own) * 2.0**-0.5


@dataclass
class RoutedBeside:
    """The MoE block: routed experts beside the dense FFN, both reading the layer's h:
    norm_1(dense) + norm_2(experts(pre_norm_2(h))), the experts routed by rmsnorm(h) * scale / sqrt(hidden)
    and their weights times a factor per expert (MoEFFN.out_scale)."""

    experts: MoEFFN
    router_norm: Array  # the router's input scale / sqrt(hidden), as an RMSNorm weight
    in_norm: Array
    dense_norm: Array
    routed_norm: Array

    def __call__(self, ops: Ops, cfg: ModelConfig, h: Array, dense: Array, rows: Array) -> Array:
        eps = cfg.norm_eps
        routed = self.experts(ops, ops.rmsnorm(h, self.in_norm, eps), rows, ops.rmsnorm(h, self.router_norm, eps))
        return ops.rmsnorm(dense, self.dense_norm, eps) + ops.rmsnorm(routed, self.routed_norm, eps)


@dataclass
class Gemma4Block:
    index: int  # the model's layer index (its column of the per-layer inputs)
    attn_norm: Array
    attn: Attention
    post_attn_norm: Array
    ffn_norm: Array
    ffn: DenseFFN
    post_ffn_norm: Array
    moe: RoutedBeside | None
    layer_input: LayerInput | None
    out_scale: float

    def __call__(self, ops: Ops, cfg: ModelConfig, x: Array, cache: PagedKVCache, batch: StepBatch) -> Array:
        eps, rows = cfg.norm_eps, batch.decode_rows
        h = ops.add_rmsnorm(x, self.attn(ops, cfg, ops.rmsnorm(x, self.attn_norm, eps), cache, batch),
                            self.post_attn_norm, eps)
        ffn = self.ffn(ops, ops.rmsnorm(h, self.ffn_norm, eps), rows)
        if self.moe is not None:
            ffn = self.moe(ops, cfg, h, ffn, rows)
        if self.layer_input is None:  # the layer's scalar on its last residual add
            return ops.add_rmsnorm(h, ffn, self.post_ffn_norm, eps, self.out_scale)
        h = ops.add_rmsnorm(h, ffn, self.post_ffn_norm, eps)
        return self.layer_input(ops, cfg, h, batch.layer_inputs[:, self.index], rows, self.out_scale)


def load_per_layer_embedding(mf: ModelFile, ops: Ops) -> PerLayerEmbedding | None:
    if not mf.config.layer_input_dim:
        return None
    return PerLayerEmbedding(ops.weight(mf.tensor("per_layer_token_embd.weight")),
                             ops.weight(mf.tensor("per_layer_model_proj.weight")),
                             ops.vector(mf.tensor("per_layer_proj_norm.weight")))


def load_gemma4_block(mf: ModelFile, ops: Ops, i: int, attn: Attention, ffn: DenseFFN,
                      experts: ExpertManager | None) -> Gemma4Block:
    """Layer i around its attention and dense FFN (transformer.load_block builds those); its routed
    experts placed by `experts` where it has them."""
    def vec(name: str) -> Array:
        return ops.vector(mf.tensor(f"blk.{i}.{name}.weight"))

    scalar = mf.tensors.get(f"blk.{i}.layer_output_scale.weight")
    layer_input = None
    if mf.config.layer_input_dim:
        layer_input = LayerInput(ops.weight(mf.tensor(f"blk.{i}.inp_gate.weight")),
                                 ops.weight(mf.tensor(f"blk.{i}.proj.weight")), vec("post_norm"))
    moe = None
    if experts is not None and mf.is_moe_layer(i):
        moe = RoutedBeside(load_moe_ffn(mf, ops, i, experts),
                           ops.vector(mf.tensor(f"blk.{i}.ffn_gate_inp.scale")) * mf.config.hidden**-0.5,
                           vec("pre_ffw_norm_2"), vec("post_ffw_norm_1"), vec("post_ffw_norm_2"))
    return Gemma4Block(i, vec("attn_norm"), attn, vec("post_attention_norm"), vec("ffn_norm"), ffn, vec("post_ffw_norm"),
                       moe, layer_input, 1.0 if scalar is None else float(ops.to_numpy(ops.vector(scalar)).reshape(-1)[0]))


def ones(ops: Ops, n: int) -> Array:
    """An RMSNorm weight that leaves the normed values as they are (gemma4's value norm has none)."""
    return ops.vector(RawTensor("ones", TensorType.F32, (n,), np.ones(n, np.float32)))
