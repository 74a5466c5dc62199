"""Gemma 4's layer stack in one compiled call: a decode step's (the CPU backend's ops.run_fused_layers
for sandwich layers, sandwich_layer.py) and a whole greedy burst's (ops.greedy_plan / greedy_burst).

Called layer by layer from Python, the fused layers ran 10-20% slower than the same compiled code
back to back: Python between the parallel regions lets the thread pool's workers go idle, and each
layer's call types ~40 arguments. Here the layers go to one loop as a numba typed List of per-layer
tuples (its fused form and the K/V stores it reads: its own, or the shared layer's), built once per
KV cache.

A greedy burst goes further (greedy_decode.py does it for a standard model): around the layers a
Gemma 4 step has the embedding scaled by sqrt(hidden), the per-layer inputs (PLE: a projection of
that embedding, normed, plus a second embedding table's rows, both scaled) and the logits
soft-capped before the argmax. Stepped from Python, that is ~15 calls a step around the layers; here
the whole burst is one loop.

The numbers are the per-step path's, bit for bit: the loop calls the compiled functions the ops
call (the embedding's row gather, sandwich_layer's halves, rmsnorm, the integer matmul, the soft
cap), each in the variant its op picks for the same work, and numpy's float32 products by a Python
float are float32 products by that float rounded to float32 here too (tests/test_sandwich_stack.py
compares every step's tokens and the K/V they leave).
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from ember.kernels.cpu import dense, twin
from ember.kernels.cpu.decoder_layer import _f32_rows, _matmul_int8, _parallel, _rmsnorm
from ember.kernels.cpu.greedy_decode import _append, _embedding, _new_list, embedding_views, take_argmax
from ember.kernels.cpu.paged_attention import KVLayerStore
from ember.kernels.cpu.quant_matmul import CpuWeight
from ember.kernels.cpu.sandwich_layer import _NO_INPUTS, SandwichLayer, _attention, _ffn
from ember.kernels.cpu.twin import PARALLEL_MIN_WORK

__all__ = ["SandwichPlan", "burst", "plan", "run_stack"]

_SOFTCAP_SERIAL, _SOFTCAP_PARALLEL = dense._SOFTCAP.serial, dense._SOFTCAP.parallel


@dataclass(frozen=True)
class SandwichPlan:
    """A whole Gemma 4 decode step over one KV cache, as the compiled loop takes it."""

    # per layer: attn, ffn, whether it reads the rings, and its K and V stores' arrays (mode, f32,
    # u16, i8, scales each)
    items: list[tuple[Any, ...]]
    embed: tuple[Any, ...]  # the embedding's code, u8, i8, u16, u32 and f32 views, columns
    embed_scale: np.float32
    # the per-layer inputs' table (as embed), projection code and bytes, norm, width, and the float32
    # factors of the projection (1 / sqrt(hidden)), the table's rows (sqrt(width)) and their sum (1 / sqrt(2))
    inputs: tuple[Any, ...]
    norm: np.ndarray
    eps: float
    head: tuple[int, np.ndarray]
    softcap: float  # 0: none

    @functools.cached_property
    def layers(self) -> Any:
        return _typed(self.items)


def plan(fused: Sequence[Any], kv_layers: Sequence[int], embed: CpuWeight, norm: np.ndarray, eps: float,
         head: CpuWeight, ks: Sequence[KVLayerStore], vs: Sequence[KVLayerStore], embed_scale: float,
         softcap: float, input_table: CpuWeight | None, input_proj: CpuWeight | None,
         input_norm: np.ndarray | None, rings: bool) -> SandwichPlan | None:
    """The plan for these fused layers (layer i reading cache layer kv_layers[i] of ks and vs), or None
    where the per-step path computes what this loop does not: a layer not fused (MoE, a matrix
    without integer decode kernels), a head or per-layer projection without integer decode kernels."""
    if not all(isinstance(f, SandwichLayer) for f in fused) or not head.int8:
        return None
    if input_proj is not None and not input_proj.int8:
        return None
    items = _items(fused, [ks[c] for c in kv_layers], [vs[c] for c in kv_layers], rings)
    width = 0 if input_norm is None else int(np.asarray(input_norm).shape[0])
    factors = (np.float32(embed.cols**-0.5), np.float32(width**0.5), np.float32(2.0**-0.5))  # as numpy rounds them
    if input_table is None:  # stand-ins the loop never reads (width 0)
        inputs = (*embedding_views(embed), head.code, head.u8, np.ascontiguousarray(norm, np.float32), 0, *factors)
    else:
        inputs = (*embedding_views(input_table), input_proj.code, input_proj.u8,  # type: ignore[union-attr]
                  np.ascontiguousarray(input_norm, np.float32), width, *factors)
    return SandwichPlan(items, embedding_views(embed), np.float32(embed_scale), inputs, np.ascontiguousarray(norm, np.float32),
                        float(eps), (head.code, head.u8), float(softcap))


def _items(fused: Sequence[SandwichLayer], ks: Sequence[KVLayerStore], vs: Sequence[KVLayerStore],
           rings: bool) -> list[tuple[Any, ...]]:
    """Per layer: its fused form, whether it reads the rings, and the arrays of the K/V stores it reads."""
    return [(layer.attn, layer.ffn, rings and layer.window > 0, k.mode, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16,
             v.i8, v.scales) for layer, k, v in zip(fused, ks, vs, strict=True)]


def _typed(items: list[tuple[Any, ...]]) -> Any:
    """items as a numba typed List (greedy_decode.GreedyPlan.layers: why compiled code builds it)."""
    layers = _new_list(items[0])
    for item in items[1:]:
        _append(layers, item)
    return layers


# per first K store of a cache, the typed List of the layers that read it (run_stack), and the layers'
# fused forms it was made of
_STACKS: weakref.WeakKeyDictionary[KVLayerStore, tuple[Sequence[Any], Any]] = weakref.WeakKeyDictionary()


def run_stack(fused: Sequence[Any], x: np.ndarray, ks: Sequence[KVLayerStore], vs: Sequence[KVLayerStore],
              step: Any) -> np.ndarray:
    """A decode step's layers (every row a decode row; layer i reading ks[i] and vs[i]) in one call ->
    the last layer's output."""
    ringed = step.window_tables is not None
    known = _STACKS.get(ks[0])
    if known is None or known[0] is not fused:
        known = (fused, _typed(_items(fused, ks, vs, ringed)))
        _STACKS[ks[0]] = known
    inputs = step.layer_inputs if fused[0].per_layer_input else _NO_INPUTS
    return _layers(_f32_rows(x), step.positions, twin.force_code(), step.kv_blocks,
                   step.window_blocks if ringed else step.kv_blocks, step.kv_offsets, step.tables,
                   step.window_tables if ringed else step.tables, step.token_seq, step.attends_to, inputs, known[1])


def burst(p: SandwichPlan, steps: int, step: Any, block_size: int, stops: np.ndarray) -> np.ndarray:
    """greedy_decode.burst for a Gemma 4 plan: step the first step's arrays (StepArrays, ring tables
    included where the cache keeps rings)."""
    n = len(step.ids)
    tokens = np.empty((steps, n), np.int64)
    rings = step.window_tables if step.window_tables is not None else step.tables
    taken = _burst(steps, twin.force_code(), np.ascontiguousarray(step.ids, np.int64),
                   np.ascontiguousarray(step.positions, np.int64), step.tables, rings,
                   np.ascontiguousarray(step.token_seq, np.int32), block_size, np.ascontiguousarray(stops, np.int64),
                   p.embed, p.embed_scale, p.inputs, p.layers, p.norm, p.eps, p.head[0], p.head[1], p.softcap, tokens)
    return tokens[:taken]


@njit(cache=True, nogil=True)
def _burst(steps, force, ids, positions, tables, rings, token_seq, block_size, stops, embed, embed_scale, inputs,
           layers, norm, eps, h_code, h_u8, softcap, tokens):
    n = ids.shape[0]
    rows = embed[1].shape[0] if embed[5].shape[0] == 0 else embed[5].shape[0]
    ids, positions = ids.copy(), positions.copy()
    kv_blocks, ring_blocks, kv_offsets = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    done = np.zeros(n, np.bool_)
    for step in range(steps):
        for i in range(n):  # this step's KV slot, in the paged tables and in the rings'
            if step:
                positions[i] += 1
            kv_blocks[i] = tables[token_seq[i], positions[i] // block_size]
            ring_blocks[i] = rings[token_seq[i], positions[i] // block_size]
            kv_offsets[i] = positions[i] % block_size
            if ids[i] < 0 or ids[i] >= rows:
                raise IndexError("token id out of the embedding's range")
        e_code, e_u8, e_i8, e_u16, e_u32, e_f32, e_cols = embed
        x = _embedding(ids, e_code, e_u8, e_i8, e_u16, e_u32, e_f32, e_cols, force)
        for i in range(n):
            for j in range(x.shape[1]):
                x[i, j] = x[i, j] * embed_scale
        per_layer = _per_layer_inputs(x, ids, force, eps, len(layers), inputs)
        x = _layers(x, positions, force, kv_blocks, ring_blocks, kv_offsets, tables, rings, token_seq, positions,
                    per_layer, layers)
        h = np.empty_like(x)
        _rmsnorm(x, norm, eps, h, force)
        out = np.empty((n, h_u8.shape[0]), np.float32)
        _matmul_int8(h_code, h_u8, h, out, force)
        if softcap:
            capped = np.empty_like(out)
            if _parallel(force, out.size * 16, PARALLEL_MIN_WORK):  # dense.softcap's measure
                _SOFTCAP_PARALLEL(out, softcap, capped)
            else:
                _SOFTCAP_SERIAL(out, softcap, capped)
            out = capped
        if take_argmax(out, step, tokens, ids, done, stops):
            return step + 1
    return steps


@njit(cache=True, nogil=True)
def _layers(x, positions, force, kv_blocks, ring_blocks, kv_offsets, tables, rings, token_seq, seen, per_layer, layers):
    """Every layer of `layers` on x (a layer that reads the rings through their tables and blocks)."""
    for k in range(len(layers)):
        attn, ffn, ringed, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc = layers[k]
        x = _attention(x, positions, force, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc,
                       ring_blocks if ringed else kv_blocks, kv_offsets, rings if ringed else tables, token_seq,
                       seen, *attn)
        x = _ffn(x, per_layer, force, *ffn)
    return x


@njit(cache=True, nogil=True)
def _per_layer_inputs(x, ids, force, eps, n_layers, inputs):
    """PerLayerEmbedding: (rmsnorm(proj(x) / sqrt(hidden)) + table[id] * sqrt(width)) / sqrt(2) ->
    [n, layers, width] (width 0: none, _NO_INPUTS)."""
    t_code, t_u8, t_i8, t_u16, t_u32, t_f32, t_cols, p_code, p_u8, p_norm, width, down, up, half = inputs
    if width == 0:
        return _NO_INPUTS
    n = x.shape[0]
    projected = np.empty((n, p_u8.shape[0]), np.float32)
    _matmul_int8(p_code, p_u8, x, projected, force)
    for i in range(n):
        for j in range(projected.shape[1]):
            projected[i, j] = projected[i, j] * down
    mixed = np.empty((n * n_layers, width), np.float32)
    _rmsnorm(projected.reshape(n * n_layers, width), p_norm, eps, mixed, force)
    own = _embedding(ids, t_code, t_u8, t_i8, t_u16, t_u32, t_f32, t_cols, force)
    out = np.empty((n, n_layers, width), np.float32)
    for i in range(n):
        for k in range(n_layers):
            for j in range(width):
                out[i, k, j] = (mixed[i * n_layers + k, j] + own[i, k * width + j] * up) * half
    return out
