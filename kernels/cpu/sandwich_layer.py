"""Gemma 4's decoder layer's decode step in one compiled call: the CPU backend's fused form of a
sandwich-normed layer (ops.SandwichWeights; the model's own code is daemon/models/gemma4.py).

Run op by op, a Gemma 4 layer is ~25 ops and ~120 Python calls around them (wrappers, numba's
argument typing, allocations, the KV write): on the 86M-parameter benchmark shape that was a fifth of
a decode step. Here it is one numba function: rmsnorm, q/k/v (one integer kernel; q/k alone where
the values are the keys' projection, q alone on a KV-shared layer), the unscaled value norm, the q/k
head norms and rope, the K/V store (in every KV dtype: q8_0 rows quantized as KVLayerStore.write does),
attention over the layer's own or a shared layer's cache (a sliding layer through its ring's
tables), the output projection, the post-attention norm and residual, the GELU-tanh FFN, the
post-FFN norm and residual, the per-layer input (PLE) where the model has one, and the layer's
scalar.

The numbers are the op-by-op path's, bit for bit, as decoder_layer.py's are: every step calls the
compiled function the op calls, in the variant the op would pick for the same work (twin.py), with
the same argument types (a float64 eps and scale, as the ops pass Python floats). A decode row
therefore gets the same logits whether its step ran fused or op by op (tests/test_sandwich_layer.py).
A MoE layer (its routed experts beside the FFN) is not fused: it runs op by op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from ember.kernels.cpu import dense, twin
from ember.kernels.cpu.decoder_layer import (_ATTENTION_PARALLEL, _ATTENTION_SERIAL, _QKV_PARALLEL, _QKV_SERIAL, _f32,
                                             _f32_rows, _matmul_int8, _parallel, _rmsnorm, gated_ffn, rope_and_store)
from ember.kernels.cpu.paged_attention import KVLayerStore
from ember.kernels.cpu.quant_matmul import _MATVEC_ROWS, INT8_PARALLEL_MIN_WORK, SERIAL_GROUP, CpuWeight
from ember.kernels.cpu.twin import PARALLEL_MIN_WORK

__all__ = ["SandwichLayer", "fuse", "run"]

_ADD_NORM_SERIAL, _ADD_NORM_PARALLEL = dense._ADD_RMSNORM.serial, dense._ADD_RMSNORM.parallel
_Q_ROPE_SERIAL, _Q_ROPE_PARALLEL = dense._ROPE.serial, dense._ROPE.parallel
_GEGLU_SERIAL, _GEGLU_PARALLEL = dense._GEGLU.serial, dense._GEGLU.parallel
_NO_INPUTS = np.zeros((1, 1, 1), np.float32)  # a model without per-layer inputs: one compiled signature


@dataclass(frozen=True)
class SandwichLayer:
    """One layer's weights and shape as the compiled call takes them."""

    attn: tuple[Any, ...]  # _attention's arguments after the step's arrays
    ffn: tuple[Any, ...]  # _ffn's after the attention's output and the per-layer inputs
    window: int  # a sliding layer's keys (0: all): it reads its cache through the ring's tables, if any
    per_layer_input: bool


def fuse(attn_norm: np.ndarray, wq: CpuWeight, wk: CpuWeight | None, wv: CpuWeight | None, wo: CpuWeight,
         q_norm: np.ndarray, k_norm: np.ndarray | None, v_norm: np.ndarray | None, post_attn_norm: np.ndarray,
         ffn_norm: np.ndarray, gate: CpuWeight, up: CpuWeight, down: CpuWeight, post_ffn_norm: np.ndarray,
         input_gate: CpuWeight | None, input_proj: CpuWeight | None, input_norm: np.ndarray | None,
         n_heads: int, kv_heads: int, head_dim: int, eps: float, inv_freq: np.ndarray, interleaved: bool,
         window: int, scale: float, out_scale: float, layer: int) -> SandwichLayer | None:
    """The layer's fused form, or None where the op-by-op path computes differently (a matrix without
    integer decode kernels) or the shapes do not chain. wk None: a KV-shared layer (it writes no
    K/V); wv None: values from the keys' projection; input_gate None: no per-layer input."""
    d = attn_norm.shape[0]
    own, k_eq_v, ple = wk is not None, wv is None, input_gate is not None
    mats = [wq, wo, gate, up, down] + ([wk] if own else []) + ([wv] if own and not k_eq_v else [])
    mats += [input_gate, input_proj] if ple else []  # type: ignore[list-item]
    if not all(w.int8 for w in mats) or own and (k_norm is None or v_norm is None):
        return None
    kv = kv_heads * head_dim
    if (wq.cols, wo.rows, wq.rows, wo.cols) != (d, d, n_heads * head_dim, n_heads * head_dim):
        return None
    if own and ((wk.cols, wk.rows) != (d, kv) or not k_eq_v and (wv.cols, wv.rows) != (d, kv)):  # type: ignore[union-attr]
        return None
    if (gate.rows, gate.cols) != (up.rows, up.cols) or gate.cols != d or (down.rows, down.cols) != (d, gate.rows):
        return None
    if ple and (input_gate.cols != d or (input_proj.rows, input_proj.cols) != (d, input_gate.rows)):  # type: ignore[union-attr]
        return None
    k_w = wk if own else wq  # stand-ins the compiled code never reads: one signature for every layer
    v_w = wv if own and not k_eq_v else k_w
    codes = np.array([wq.code, k_w.code] + ([] if k_eq_v else [v_w.code]), np.int64)  # type: ignore[union-attr]
    attn = (_f32(attn_norm), codes, wq.u8, k_w.u8, v_w.u8, own, k_eq_v, _f32(q_norm), _f32(k_norm), _f32(v_norm),  # type: ignore[union-attr]
            _f32(inv_freq), bool(interleaved), n_heads, kv_heads, head_dim, float(eps), np.float32(scale),
            np.int64(window), wo.code, wo.u8, _f32(post_attn_norm))
    ig, ip = (input_gate, input_proj) if ple else (gate, down)
    ffn = (_f32(ffn_norm), float(eps), gate.code, gate.u8, up.code, up.u8, down.code, down.u8, _f32(post_ffn_norm),
           float(out_scale), np.int64(layer if ple else -1), ig.code, ig.u8, ip.code, ip.u8, _f32(input_norm))  # type: ignore[union-attr]
    return SandwichLayer(attn, ffn, int(window), ple)


def run(layer: SandwichLayer, x: np.ndarray, k: KVLayerStore, v: KVLayerStore, step: Any) -> np.ndarray:
    """The layer on x [n, hidden] (every row a decode row) -> its output [n, hidden], its K/V written
    (unless KV-shared) and read as the ops do. step: the step's arrays (StepArrays), a sliding
    layer's ring tables and blocks included where the cache keeps rings."""
    ring = layer.window > 0 and step.window_tables is not None
    tables, blocks = (step.window_tables, step.window_blocks) if ring else (step.tables, step.kv_blocks)
    inputs = step.layer_inputs if layer.per_layer_input else _NO_INPUTS
    force = twin.force_code()
    h = _attention(_f32_rows(x), step.positions, force, k.mode, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8,
                   v.scales, blocks, step.kv_offsets, tables, step.token_seq, step.attends_to, *layer.attn)
    return _ffn(h, inputs, force, *layer.ffn)


@njit(cache=True, nogil=True)
def _attention(x, positions, force, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets,
               tables, token_seq, seen, attn_norm, codes, wq, wk, wv, own, k_eq_v, q_norm, k_norm, v_norm, inv_freq,
               interleaved, n_heads, kv_heads, head_dim, eps, scale, window, code_o, wo, post_norm):
    """x + post_norm(attention(attn_norm(x))): Attention.__call__ and Gemma4Block's first residual."""
    n = x.shape[0]
    h = np.empty_like(x)
    _rmsnorm(x, attn_norm, eps, h, force)
    q = np.empty((n, wq.shape[0]), np.float32)
    if own:
        q3 = _own_queries(h, positions, force, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                          kv_offsets, codes, wq, wk, wv, k_eq_v, q_norm, k_norm, v_norm, inv_freq, interleaved, n_heads,
                          kv_heads, head_dim, eps, q)
    else:  # a KV-shared layer: q alone, normed, then roped (ops.rmsnorm and ops.rope)
        _matmul_int8(codes[0], wq, h, q, force)
        q3 = np.empty((n, n_heads, head_dim), np.float32)
        _rmsnorm(q.reshape(n * n_heads, head_dim), q_norm, eps, q3.reshape(n * n_heads, head_dim), force)
        if _parallel(force, q3.size * 8, PARALLEL_MIN_WORK):
            _Q_ROPE_PARALLEL(q3, positions, inv_freq, interleaved)
        else:
            _Q_ROPE_SERIAL(q3, positions, inv_freq, interleaved)
    attn = np.empty_like(q3)
    context = seen[-1] + 1  # paged_attention's measure of the work, as the op picks its variant
    if _parallel(force, q3.size * 2 * (min(context, window) if window > 0 else context), PARALLEL_MIN_WORK):
        _ATTENTION_PARALLEL(q3, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, tables, token_seq, seen,
                            window, scale, attn)
    else:
        _ATTENTION_SERIAL(q3, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, tables, token_seq, seen,
                          window, scale, attn)
    o = np.empty((n, wo.shape[0]), np.float32)
    _matmul_int8(code_o, wo, attn.reshape(n, n_heads * head_dim), o, force)
    out = np.empty_like(x)
    _add_rmsnorm(x, o, post_norm, eps, 1.0, out, force)
    return out


@njit(cache=True, nogil=True)
def _own_queries(h, positions, force, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets,
                 codes, wq, wk, wv, k_eq_v, q_norm, k_norm, v_norm, inv_freq, interleaved, n_heads, kv_heads, head_dim,
                 eps, q):
    """Attention._queries of a layer with its own K/V: q, k (and v) in one integer kernel, the values
    normed (from the keys' projection where k_eq_v), q and k normed and roped, k and v stored ->
    the queries [n, heads, head_dim]."""
    n = h.shape[0]
    k = np.empty((n, wk.shape[0]), np.float32)
    if k_eq_v:
        if _parallel(force, (wq.size + wk.size) * n, INT8_PARALLEL_MIN_WORK):
            _QKV_PARALLEL(codes, (wq, wk), h, (q, k), _MATVEC_ROWS)
        else:
            _QKV_SERIAL(codes, (wq, wk), h, (q, k), SERIAL_GROUP)
        projected = k
    else:
        projected = np.empty((n, wv.shape[0]), np.float32)
        if _parallel(force, (wq.size + wk.size + wv.size) * n, INT8_PARALLEL_MIN_WORK):
            _QKV_PARALLEL(codes, (wq, wk, wv), h, (q, k, projected), _MATVEC_ROWS)
        else:
            _QKV_SERIAL(codes, (wq, wk, wv), h, (q, k, projected), SERIAL_GROUP)
    v3 = np.empty((n, kv_heads, head_dim), np.float32)  # normed before the keys are, which may be the values
    _rmsnorm(projected.reshape(n * kv_heads, head_dim), v_norm, eps, v3.reshape(n * kv_heads, head_dim), force)
    q3 = q.reshape(n, n_heads, head_dim)
    k3 = k.reshape(n, kv_heads, head_dim)
    rope_and_store(q3, k3, v3, q_norm, k_norm, True, eps, positions, inv_freq, interleaved, force, mode, k_f32, k_u16,
                   k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets)
    return q3


@njit(cache=True, nogil=True)
def _ffn(h, inputs, force, ffn_norm, eps, code_g, gate, code_u, up, code_d, down, post_norm, out_scale, layer,
         code_ig, input_gate, code_ip, input_proj, input_norm):
    """(h + post_norm(ffn(ffn_norm(h)))) * out_scale, or with a per-layer input (layer >= 0: its column
    of inputs [n, layers, P]) that added first: Gemma4Block's FFN, LayerInput and scalar."""
    n = h.shape[0]
    h2 = np.empty_like(h)
    _rmsnorm(h, ffn_norm, eps, h2, force)
    y = gated_ffn(code_g, gate, code_u, up, code_d, down, h2, force, True)
    out = np.empty_like(h)
    if layer < 0:
        _add_rmsnorm(h, y, post_norm, eps, out_scale, out, force)
        return out
    _add_rmsnorm(h, y, post_norm, eps, 1.0, out, force)
    g = np.empty((n, input_gate.shape[0]), np.float32)
    _matmul_int8(code_ig, input_gate, out, g, force)
    p = np.empty_like(g)
    for i in range(n):
        p[i] = inputs[i, layer]
    mixed = np.empty_like(g)
    if _parallel(force, g.size * 16, PARALLEL_MIN_WORK):  # dense.geglu's measure
        _GEGLU_PARALLEL(g, p, mixed)
    else:
        _GEGLU_SERIAL(g, p, mixed)
    projected = np.empty((n, input_proj.shape[0]), np.float32)
    _matmul_int8(code_ip, input_proj, mixed, projected, force)
    final = np.empty_like(h)
    _add_rmsnorm(out, projected, input_norm, eps, out_scale, final, force)
    return final


@njit(inline="always", cache=True, nogil=True)
def _add_rmsnorm(x, y, w, eps, scale, out, force):
    if _parallel(force, y.size, PARALLEL_MIN_WORK):
        _ADD_NORM_PARALLEL(x, y, w, eps, scale, out)
    else:
        _ADD_NORM_SERIAL(x, y, w, eps, scale, out)
