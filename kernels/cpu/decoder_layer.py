"""A standard decoder layer's decode step in one or two compiled calls: Python off the per-op path.

This module owns the CPU backend's fused form of a layer (ops.fuse_layer / ops.run_fused_layer):
pre-norm attention (optional q/k/v biases and q/k head norms) and a gated FFN whose seven matrices
all take the integer decode kernels (every block type), run for a step whose rows are all
decode rows. Run op by op, such a layer costs ~110 Python calls (wrappers, numba's argument typing
for each kernel, array allocations): on the 12 MB demo model that host work was a third of a decode
step. Here the whole layer is two numba functions, `_attention_in` (norm, q/k/v, q/k norm and rope,
the K/V store) and `_attention_out` (attention, output projection, residual, norm, SwiGLU FFN,
residual). The K/V rows are stored in compiled code in every KV dtype (paged_attention.store_kv_rows,
bit for bit KVLayerStore.write's conversions and q8_0 quantization; until 2026-11-29 a q8_0 row went
through Python, two calls a layer). `_layer_stored_kv` runs both halves in one call, and where the
layer's work is worth the threads, `_layer_team` runs it in one parallel region instead of one per
parallel kernel: its threads share out each phase's items (tokens, row groups, attention tasks) and
wait for each other only between phases (kernels/cpu/team.py). Decode tokens 2-7% faster on the demo
and the 100M Q8_0 and Q4_K_M files (a fork-join costs 1.5-4 us here, and a layer had four or five).

The numbers are the op-by-op path's, bit for bit: the functions call the very kernels the ops call
(quant_matmul's integer drivers, dense.py's norms and rope, paged_attention's kernel), each in the
serial or parallel variant the op would pick for the same work (twin.py), or, on the team, the
compiled row, token and task functions those variants call; the residual adds are the same float32
adds. A decode row therefore gets the same logits whether its step ran fused
(every row a decode row) or op by op (a step with prompt rows): batching never changes a token
(tests/test_decoder_layer.py compares the two on every integer weight type and KV dtype).

Calling a compiled function's entry point for a signature resolved once would skip numba's argument
typing (measured: 2 us -> 1 us for 20 arguments), but the entry point trusts its arguments' types
blindly; at one or two calls per layer the dispatcher's check was kept.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit, prange

from ember.kernels.cpu import decode_lanes, dense, twin
from ember.kernels.cpu.dense import softplus_gate_row
from ember.kernels.cpu.paged_attention import KVLayerStore, attention_task, store_kv_rows
from ember.kernels.cpu.paged_attention import _KERNELS as _ATTENTION
from ember.kernels.cpu.quant_matmul import (_MATMUL_INT8, _MATMUL_INT8_MANY, _MATVEC_ROWS, _Q8_0_ACTIVATIONS, _SWIGLU_INT8,
                                            INT8_PARALLEL_MIN_WORK, SERIAL_GROUP, CpuWeight, _quantize_token,
                                            _quantized_tokens, _rows_tiles, _rows_with_lanes, _silu_times)
from ember.kernels.cpu.team import claim, counters_for, fail, failed, finish, join, wait
from ember.kernels.cpu.twin import PARALLEL_MIN_WORK

__all__ = ["FusedLayer", "fuse", "run", "run_stack"]

# each twin's variants as globals of their own: compiled code calls a dispatcher, not an attribute
_QKV_SERIAL, _QKV_PARALLEL = _MATMUL_INT8_MANY.serial, _MATMUL_INT8_MANY.parallel
_MATMUL_SERIAL, _MATMUL_PARALLEL = _MATMUL_INT8.serial, _MATMUL_INT8.parallel
_SWIGLU_SERIAL, _SWIGLU_PARALLEL = _SWIGLU_INT8.serial, _SWIGLU_INT8.parallel
_NORM_SERIAL, _NORM_PARALLEL = dense._RMSNORM.serial, dense._RMSNORM.parallel
_ROPE_SERIAL, _ROPE_PARALLEL = dense._QK_NORM_ROPE.serial, dense._QK_NORM_ROPE.parallel
_ATTENTION_SERIAL, _ATTENTION_PARALLEL = _ATTENTION.serial, _ATTENTION.parallel
_NONE = np.zeros(0, np.float32)  # an absent bias or norm: one compiled signature for every model

# The compiled functions below call parallel kernels, whose code loaded from numba's cache jumps into
# the thread pool without starting it: in a process that had run no parallel kernel yet, that call
# crashed (segfault). twin.py, imported above, starts the pool when it is imported.


@dataclass(frozen=True)
class FusedLayer:
    """One layer's weights and shape as the two compiled calls take them."""

    attn_in: tuple[Any, ...]  # the arguments of _attention_in after x, positions and force
    attn_out: tuple[Any, ...]  # those of _attention_out after the step's arrays
    work: int  # the weight bytes a token reads: whether the layer runs on the thread team


def fuse(attn_norm: np.ndarray, wq: CpuWeight, wk: CpuWeight, wv: CpuWeight, wo: CpuWeight, bq: np.ndarray | None,
         bk: np.ndarray | None, bv: np.ndarray | None, q_norm: np.ndarray | None, k_norm: np.ndarray | None,
         ffn_norm: np.ndarray | None, gate: CpuWeight | None, up: CpuWeight | None, down: CpuWeight | None,
         out_gate: CpuWeight | None, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, inv_freq: np.ndarray,
         interleaved: bool, window: int = 0, scale: float = 0.0) -> FusedLayer | None:
    """The layer's fused form (without FFN matrices: its attention and residual only), or None where
    the op-by-op path computes differently (a matrix without integer decode kernels, gate and up of
    different shapes) or the shapes do not chain. out_gate: laguna's softplus output gate (a value a
    head or an element); window: a sliding window's keys (0: all); scale: the scores' (0: head_dim^-1/2)."""
    d = attn_norm.shape[0]
    gated = out_gate is not None
    if gated and not (out_gate.int8 and out_gate.cols == d and out_gate.rows in (n_heads, n_heads * head_dim)):
        return None
    ffn = gate is not None
    if ffn and not (gate.int8 and up.int8 and down.int8 and (gate.rows, gate.cols) == (up.rows, up.cols) == (down.cols, d)
                    and down.rows == d):
        return None
    if not all(w.int8 for w in (wq, wk, wv, wo)) or (wq.cols, wk.cols, wv.cols, wo.rows) != (d,) * 4:
        return None
    if (wq.rows, wk.rows, wv.rows, wo.cols) != (n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim,
                                                 n_heads * head_dim):
        return None
    biased, normed = bq is not None, q_norm is not None
    og = out_gate if gated else wq  # a stand-in the compiled code never reads: one signature for every layer
    attn_in = (_f32(attn_norm), np.array([wq.code, wk.code, wv.code], np.int64), wq.u8, wk.u8, wv.u8,
               biased, _f32(bq), _f32(bk), _f32(bv), normed, _f32(q_norm), _f32(k_norm), _f32(inv_freq),
               bool(interleaved), n_heads, n_kv_heads, head_dim, float(eps), gated, og.code, og.u8)
    mats = (gate, up, down) if ffn else (wo, wo, wo)  # stand-ins the compiled code never reads
    attn_out = (np.float32(scale or head_dim**-0.5), wo.code, wo.u8, ffn, _f32(ffn_norm), float(eps),
                *(v for w in mats for v in (w.code, w.u8)), np.int64(window))
    work = sum(w.nbytes for w in (wq, wk, wv, wo) + ((gate, up, down) if ffn else ()) + ((out_gate,) if gated else ()))
    return FusedLayer(attn_in, attn_out, work)


def _f32(v: np.ndarray | None) -> np.ndarray:
    """A writable float32 copy (vectors are tiny): a file's read-only views would be another numba
    type, compiled again at run time, outside the kernel cache."""
    return _NONE if v is None else np.array(v, np.float32)


def run(layer: FusedLayer, x: np.ndarray, k: KVLayerStore, v: KVLayerStore, positions: np.ndarray,
        seen: np.ndarray, kv_blocks: np.ndarray, kv_offsets: np.ndarray, tables: np.ndarray,
        token_seq: np.ndarray) -> np.ndarray:
    """The layer on x [n, hidden] (every row a decode row, roped at `positions`, token i attending
    to its sequence's keys 0 .. seen[i]), its K/V written as KVLayerStore.write writes them -> the
    layer's output [n, hidden]."""
    return run_stack((layer,), x, (k,), (v,), positions, seen, kv_blocks, kv_offsets, tables, token_seq)


def run_stack(layers: Sequence[FusedLayer], x: np.ndarray, ks: Sequence[KVLayerStore], vs: Sequence[KVLayerStore],
              positions: np.ndarray, seen: np.ndarray, kv_blocks: np.ndarray, kv_offsets: np.ndarray,
              tables: np.ndarray, token_seq: np.ndarray, routed: Sequence[Any | None] = ()) -> np.ndarray:
    """`layers` one after another on x, layer i's K/V in ks[i] and vs[i], each as `run` runs it, and
    where routed[i] is given (expert_ffn.FusedRouted: a layer fused without its FFN) its routed FFN
    after it. The step's choices are made once, and nothing else runs between the layers' compiled
    calls: Python right after the kernels runs several times slower than at rest (docs/runtime.md)."""
    force, threads = twin.force_code(), twin.threads()
    x = _f32_rows(x)
    for i, (layer, k, v) in enumerate(zip(layers, ks, vs, strict=True)):
        x = _stack_layer(layer, x, k, v, positions, seen, kv_blocks, kv_offsets, tables, token_seq, force, threads)
        if i < len(routed) and routed[i] is not None:
            x = routed[i](x, force)
    return x


def _stack_layer(layer: FusedLayer, x: np.ndarray, k: KVLayerStore, v: KVLayerStore, positions: np.ndarray,
                 seen: np.ndarray, kv_blocks: np.ndarray, kv_offsets: np.ndarray, tables: np.ndarray,
                 token_seq: np.ndarray, force: int, threads: int) -> np.ndarray:
    """One layer of run_stack, in the variant its work calls for: the thread team, or one serial call."""
    if force == 2 or (force == 0 and layer.work * x.shape[0] >= INT8_PARALLEL_MIN_WORK):
        return _layer_team(threads, x, positions, k.mode, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8, v.scales,
                           kv_blocks, kv_offsets, tables, token_seq, seen, layer.attn_in, layer.attn_out)
    return _layer_stored_kv(x, positions, force, k.mode, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8, v.scales,
                            kv_blocks, kv_offsets, tables, token_seq, seen, layer.attn_in, layer.attn_out)


def _f32_rows(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 and x.flags.c_contiguous and x.ndim == 2 else dense.f32_rows(x)


@njit(inline="always", cache=True, nogil=True)
def _parallel(force, work, threshold):
    """twin.Twin.pick inside compiled code: force 1 serial, 2 parallel, 0 by the work."""
    return force == 2 or (force == 0 and work >= threshold)


@njit(cache=True, nogil=True)
def _attention_in(x, positions, force, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets,
                  attn_norm, codes, wq, wk, wv, biased, bq, bk, bv, normed, q_norm, k_norm, inv_freq, interleaved,
                  n_heads, n_kv_heads, head_dim, eps, gated, code_og, wog):
    """rmsnorm, then q, k, v (one integer kernel), biases, q/k head norms and rope -> q [n, heads, hd],
    k, v [n, kv_heads, hd] and the output gate's logits g [n, gate rows] (0 columns if not `gated`):
    Block's attention up to the KV write, with the ops' kernels; with `store`, k and v written to the
    cache's f32, f16 or bf16 arrays too (what the store's write does: two Python calls fewer per
    layer, ~8 us on the demo)."""
    n = x.shape[0]
    h = np.empty_like(x)
    _rmsnorm(x, attn_norm, eps, h, force)
    q = np.empty((n, wq.shape[0]), np.float32)
    k = np.empty((n, wk.shape[0]), np.float32)
    v = np.empty((n, wv.shape[0]), np.float32)
    if _parallel(force, (wq.size + wk.size + wv.size) * n, INT8_PARALLEL_MIN_WORK):
        _QKV_PARALLEL(codes, (wq, wk, wv), h, (q, k, v), _MATVEC_ROWS)
    else:
        _QKV_SERIAL(codes, (wq, wk, wv), h, (q, k, v), SERIAL_GROUP)
    g = np.empty((n, wog.shape[0] if gated else 0), np.float32)
    if gated:
        _matmul_int8(code_og, wog, h, g, force)
    if biased:
        q, k, v = q + bq, k + bk, v + bv
    q3 = q.reshape(n, n_heads, head_dim)
    k3 = k.reshape(n, n_kv_heads, head_dim)
    v3 = v.reshape(n, n_kv_heads, head_dim)
    qn = q_norm if normed else inv_freq[:0]
    kn = k_norm if normed else inv_freq[:0]
    rope_and_store(q3, k3, v3, qn, kn, normed, eps, positions, inv_freq, interleaved, force, mode, k_f32, k_u16, k_i8,
                   k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets)
    return q3, g


@njit(inline="always", cache=True, nogil=True)
def rope_and_store(q3, k3, v3, q_norm, k_norm, normed, eps, positions, inv_freq, interleaved, force, mode, k_f32, k_u16,
                   k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets):
    """q and k head-normed (where `normed`) and roped in place (ops.qk_norm_rope's variant), then
    each token's k and v rows stored in the cache's dtype: the attention's last steps before the
    scores (this layer's and gemma4's, sandwich_layer.py)."""
    if _parallel(force, (q3.size + k3.size) * 8, PARALLEL_MIN_WORK):
        _ROPE_PARALLEL(q3, k3, q_norm, k_norm, normed, eps, positions, inv_freq, interleaved)
    else:
        _ROPE_SERIAL(q3, k3, q_norm, k_norm, normed, eps, positions, inv_freq, interleaved)
    for i in range(q3.shape[0]):
        store_kv_rows(mode, k3[i], v3[i], k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks[i],
                      kv_offsets[i])


@njit(cache=True, nogil=True)
def _layer_stored_kv(x, positions, force, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                     kv_offsets, tables, token_seq, seen, attn_in, attn_out):
    """The layer in one serial call, its K/V stored in the cache's dtype (the arrays a mode does not
    use are the store's 1-element placeholders): one dispatch and no returned q/k/v between the halves."""
    q, g = _attention_in(x, positions, force, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                         kv_offsets, *attn_in)
    return _attention_out(x, q, g, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, tables, token_seq,
                          seen, force, *attn_out)


@njit(cache=True, nogil=True)
def _attention_out(x, q, g, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, tables, token_seq, seen,
                   force, scale, code_o, wo, ffn, ffn_norm, eps, code_g, gate, code_u, up, code_d, down, window):
    """Attention over the paged cache (the last `window` keys of each token where window > 0), the
    output gate where g has columns, the output projection and residual, then (if `ffn`) rmsnorm,
    the SwiGLU FFN and its residual -> the layer's output [n, hidden] (the attention residual
    without `ffn`)."""
    n, heads, hd = q.shape
    attn = np.empty_like(q)
    context = seen[-1] + 1  # paged_attention's measure of the work, as the op picks its variant
    if _parallel(force, q.size * 2 * (min(context, window) if window > 0 else context), PARALLEL_MIN_WORK):
        _ATTENTION_PARALLEL(q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, tables, token_seq,
                            seen, window, scale, attn)
    else:
        _ATTENTION_SERIAL(q, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, tables, token_seq,
                          seen, window, scale, attn)
    if g.shape[1]:
        for i in range(n):
            softplus_gate_row(attn[i], g[i])
    o = np.empty((n, wo.shape[0]), np.float32)
    _matmul_int8(code_o, wo, attn.reshape(n, heads * hd), o, force)
    x = x + o
    if not ffn:
        return x
    h = np.empty_like(x)
    _rmsnorm(x, ffn_norm, eps, h, force)
    return x + gated_ffn(code_g, gate, code_u, up, code_d, down, h, force, False)


@njit(inline="always", cache=True, nogil=True)
def gated_ffn(code_g, gate, code_u, up, code_d, down, h, force, gelu):
    """down(silu(gate(h)) * up(h)) (gelu_tanh in silu's place where `gelu`) for decode rows h, in the
    variants the ops would pick: a dense FFN's, a routed expert's, a shared expert's, gemma4's."""
    f = np.empty((h.shape[0], gate.shape[0]), np.float32)
    if _parallel(force, 2 * gate.size * h.shape[0], INT8_PARALLEL_MIN_WORK):
        _SWIGLU_PARALLEL(code_g, gate, code_u, up, h, f, gelu)
    else:
        _SWIGLU_SERIAL(code_g, gate, code_u, up, h, f, gelu)
    y = np.empty((h.shape[0], down.shape[0]), np.float32)
    _matmul_int8(code_d, down, f, y, force)
    return y


@njit(inline="always", cache=True, nogil=True)
def _rmsnorm(x, w, eps, out, force):
    if _parallel(force, x.size, PARALLEL_MIN_WORK):
        _NORM_PARALLEL(x, w, eps, out)
    else:
        _NORM_SERIAL(x, w, eps, out)


@njit(inline="always", cache=True, nogil=True)
def _matmul_int8(code, w, x, out, force):
    if _parallel(force, w.size * x.shape[0], INT8_PARALLEL_MIN_WORK):
        _MATMUL_PARALLEL(code, w, x, out)
    else:
        _MATMUL_SERIAL(code, w, x, out)


# The phases of the team program (team.py) of a layer over an f32, f16 or bf16 KV cache, in order.
_NORM_IN, _QKV, _ROPE_STORE, _ATTEND, _QUANTIZE_ATTN, _OUT_PROJ, _NORM_FFN, _GATE_UP, _QUANTIZE_FFN, _DOWN = range(10)
_PHASES = _DOWN + 1


@njit(parallel=True, cache=True, nogil=True)
def _layer_team(threads, x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets,
                tables, token_seq, seen, attn_in, attn_out):
    """_layer_stored_kv's layer in one parallel region instead of one a kernel: the threads run
    _team_member's phases together (team.py), `threads` of them (numba's count, read by the caller:
    reading it here would keep this function out of the cache). The same compiled row, token and
    attention-task code as the serial and parallel kernels computes every value, so the results are
    theirs bit for bit.
    Nothing but the team's loop is here: numba would make a parallel region of any array expression."""
    # (flat tuples only: a parallel loop's body takes no tuple of tuples)
    bufs, h_room, attn_room, h2_room, f_room = _team_buffers(x, attn_in, attn_out)
    counters = counters_for(_PHASES, threads)
    for _ in prange(threads):
        _team_member(counters, x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                     kv_offsets, tables, token_seq, seen, attn_in, attn_out, bufs, h_room, attn_room, h2_room, f_room)
    if failed(counters):
        raise RuntimeError("the fused decoder layer failed in a thread of its team")
    return bufs[11] if attn_out[3] else bufs[6]


@njit(cache=True, nogil=True)
def _layer_alone(x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks, kv_offsets, tables,
                 token_seq, seen, attn_in, attn_out):
    """_layer_team's layer with one member, run on the calling thread: the same phases and numbers
    without a parallel region, whose launch cost ~5 us of a ~35 us layer of the trained MoE demo
    with one thread (2-core Zen 3 VM)."""
    bufs, h_room, attn_room, h2_room, f_room = _team_buffers(x, attn_in, attn_out)
    _team_phases(counters_for(_PHASES, 1), x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc,
                 kv_blocks, kv_offsets, tables, token_seq, seen, attn_in, attn_out, bufs, h_room, attn_room, h2_room,
                 f_room)
    return bufs[11] if attn_out[3] else bufs[6]


@njit(cache=True, nogil=True)
def _team_buffers(x, attn_in, attn_out):
    """_team_member's arrays: every intermediate of the layer, each token's activations quantized
    in the formats of the weights that read them."""
    codes, wq, wk, wv = attn_in[1], attn_in[2], attn_in[3], attn_in[4]
    n_heads, head_dim, gated, wog = attn_in[14], attn_in[16], attn_in[18], attn_in[20]
    code_o, ffn, code_g, gate, code_u, code_d = attn_out[1], attn_out[3], attn_out[6], attn_out[7], attn_out[8], \
        attn_out[10]
    n, d = x.shape
    m = n if ffn else 0
    f_rows = gate.shape[0] if ffn else 0
    h_room = _room(n, d, _Q8_0_ACTIVATIONS[codes].any(), not _Q8_0_ACTIVATIONS[codes].all())
    attn_room = _room(n, n_heads * head_dim, _Q8_0_ACTIVATIONS[code_o], not _Q8_0_ACTIVATIONS[code_o])
    h2_room = _room(m, d, _Q8_0_ACTIVATIONS[code_g] or _Q8_0_ACTIVATIONS[code_u],
                    not (_Q8_0_ACTIVATIONS[code_g] and _Q8_0_ACTIVATIONS[code_u]))
    f_room = _room(m, f_rows, _Q8_0_ACTIVATIONS[code_d], not _Q8_0_ACTIVATIONS[code_d])
    bufs = (np.empty_like(x), np.empty((n, wq.shape[0]), np.float32), np.empty((n, wk.shape[0]), np.float32),
            np.empty((n, wv.shape[0]), np.float32), np.empty((n, n_heads, head_dim), np.float32),
            np.empty((n, d), np.float32), np.empty((n, d), np.float32), np.empty((m, d), np.float32),
            np.empty((m, f_rows), np.float32), np.empty((m, f_rows), np.float32), np.empty((m, f_rows), np.float32),
            np.empty((n, d), np.float32), np.empty((n, wog.shape[0] if gated else 0), np.float32))
    return bufs, h_room, attn_room, h2_room, f_room


@njit(inline="always", cache=True, nogil=True)
def _room(n, cols, q8_0, k_quants):
    """Quantized activations of n tokens in the formats some weights need: quant_matmul's q8_0 arrays,
    then its q8_K ones, in one flat tuple."""
    return _quantized_tokens(n if q8_0 else 0, cols, False) + _quantized_tokens(n if k_quants else 0, cols, True)


@njit(inline="always", cache=True, nogil=True)
def _quantize_into(x, t, room):
    _quantize_token(x, t, room[0].shape[0] > 0, room[0], room[1], room[2], room[3], room[4], room[5].shape[0] > 0,
                    room[5], room[6], room[7], room[8])


@njit(inline="always", cache=True, nogil=True)
def _groups(rows):
    return (rows + _MATVEC_ROWS - 1) // _MATVEC_ROWS


@njit(inline="always", cache=True, nogil=True)
def _group_rows(tt, w, group, room, out):
    """Row group `group` of w times the quantized tokens in `room` -> out's columns of those rows."""
    first = group * _MATVEC_ROWS
    end = min(w.shape[0], first + _MATVEC_ROWS)
    # the room's arrays by index: no variable that is one array or another; each loop called directly
    # (quant_matmul.py: an inlined helper's argument copies are reference counts)
    if _Q8_0_ACTIVATIONS[tt]:
        if decode_lanes.tokens_in(room[4], out.shape[0]) > 0:
            _rows_with_lanes(tt, w, first, end, room[0], room[1], room[2], room[3], room[4], out)
        else:
            _rows_tiles(tt, w, first, end, room[0], room[1], room[2], room[3], out)
    elif decode_lanes.tokens_in(room[9], out.shape[0]) > 0:
        _rows_with_lanes(tt, w, first, end, room[5], room[6], room[7], room[8], room[9], out)
    else:
        _rows_tiles(tt, w, first, end, room[5], room[6], room[7], room[8], out)


@njit(inline="always", cache=True, nogil=True)
def _add_rows(a, b, group, out):
    """out = a + b on row group `group`'s columns (a residual added where its rows were computed). The
    columns are indexed unsigned: with a signed index numba selects index + length for a negative
    one, and LLVM made the loop gathers and scatters (1-2% of an 8-stream step of the 100M Q8_0
    model; 8 x 2048 values 15.7 -> 8.9 us, one thread)."""
    for t in range(out.shape[0]):
        for r in range(group * _MATVEC_ROWS, min(out.shape[1], (group + 1) * _MATVEC_ROWS)):
            i = np.uint64(r)
            out[t, i] = a[t, i] + b[t, i]


@njit(cache=True, nogil=True)
def _team_member(counters, x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                 kv_offsets, tables, token_seq, seen, attn_in, attn_out, bufs, h_room, attn_room, h2_room, f_room):
    try:
        _team_phases(counters, x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                     kv_offsets, tables, token_seq, seen, attn_in, attn_out, bufs, h_room, attn_room, h2_room, f_room)
    except Exception:  # noqa: BLE001 (numba catches no narrower)
        fail(counters)


@njit(cache=True, nogil=True)
def _team_phases(counters, x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                 kv_offsets, tables, token_seq, seen, attn_in, attn_out, bufs, h_room, attn_room, h2_room, f_room):
    """One thread's run of the layer's phases: in each, it claims items until none is left, then
    waits for the items others claimed. Each phase's items: tokens, row groups or attention tasks."""
    (attn_norm, codes, wq, wk, wv, biased, bq, bk, bv, normed, q_norm, k_norm, inv_freq, interleaved, n_heads,
     n_kv_heads, head_dim, eps, gated, code_og, wog) = attn_in
    scale, code_o, wo, ffn, ffn_norm, ffn_eps, code_g, gate, code_u, up, code_d, down, window = attn_out
    h, q, k, v, attn, o, x1, h2, g, u, f, out, og = bufs
    n = x.shape[0]
    me = join(counters)

    if not _norm_phase(counters, _NORM_IN, me, x, attn_norm, eps, h, h_room):
        return

    gq, gk, gv = _groups(wq.shape[0]), _groups(wk.shape[0]), _groups(wv.shape[0])
    items = gq + gk + gv + (_groups(wog.shape[0]) if gated else 0)  # the output gate's rows last
    c = claim(counters, _QKV, me, items)
    while c < items:
        if c < gq:
            _group_rows(codes[0], wq, c, h_room, q)
        elif c < gq + gk:
            _group_rows(codes[1], wk, c - gq, h_room, k)
        elif c < gq + gk + gv:
            _group_rows(codes[2], wv, c - gq - gk, h_room, v)
        else:
            _group_rows(code_og, wog, c - gq - gk - gv, h_room, og)
        finish(counters, _QKV)
        c = claim(counters, _QKV, me, items)
    if not wait(counters, _QKV, items):
        return

    q3 = q.reshape(n, n_heads, head_dim)
    k3 = k.reshape(n, n_kv_heads, head_dim)
    v3 = v.reshape(n, n_kv_heads, head_dim)
    qn = q_norm if normed else inv_freq[:0]
    kn = k_norm if normed else inv_freq[:0]
    i = claim(counters, _ROPE_STORE, me, n)
    while i < n:
        if biased:
            _add_bias(q[i], bq)
            _add_bias(k[i], bk)
            _add_bias(v[i], bv)
        _ROPE_SERIAL(q3[i:i + 1], k3[i:i + 1], qn, kn, normed, eps, positions[i:i + 1], inv_freq, interleaved)
        store_kv_rows(mode, k3[i], v3[i], k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks[i],
                      kv_offsets[i])
        finish(counters, _ROPE_STORE)
        i = claim(counters, _ROPE_STORE, me, n)
    if not wait(counters, _ROPE_STORE, n):
        return

    c = claim(counters, _ATTEND, me, n * n_kv_heads)
    while c < n * n_kv_heads:
        attention_task(c, q3, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, mode, tables, token_seq, seen,
                       window, scale, attn)
        finish(counters, _ATTEND)
        c = claim(counters, _ATTEND, me, n * n_kv_heads)
    if not wait(counters, _ATTEND, n * n_kv_heads):
        return

    per = decode_lanes.tokens_per_thread(attn_room[4])
    items = _items(n, per)
    c = claim(counters, _QUANTIZE_ATTN, me, items)  # each token's attention output gated, then quantized
    while c < items:
        for i in range(c * per, min(n, (c + 1) * per)):
            if gated:
                softplus_gate_row(attn[i], og[i])
            _quantize_into(attn.reshape(n, n_heads * head_dim), i, attn_room)
        finish(counters, _QUANTIZE_ATTN)
        c = claim(counters, _QUANTIZE_ATTN, me, items)
    if not wait(counters, _QUANTIZE_ATTN, items):
        return
    _projection_phase(counters, _OUT_PROJ, me, code_o, wo, attn_room, o, x, x1)
    if not ffn or not wait(counters, _OUT_PROJ, _groups(wo.shape[0])):
        return
    if not _norm_phase(counters, _NORM_FFN, me, x1, ffn_norm, ffn_eps, h2, h2_room):
        return

    c = claim(counters, _GATE_UP, me, _groups(gate.shape[0]))
    while c < _groups(gate.shape[0]):
        _group_rows(code_g, gate, c, h2_room, g)  # the group's gate rows, then its up rows, as _swiglu_int8
        _group_rows(code_u, up, c, h2_room, u)
        _silu_times(g, u, c * _MATVEC_ROWS, min(f.shape[1], (c + 1) * _MATVEC_ROWS), f)
        finish(counters, _GATE_UP)
        c = claim(counters, _GATE_UP, me, _groups(gate.shape[0]))
    if not wait(counters, _GATE_UP, _groups(gate.shape[0])):
        return

    if _quantize_phase(counters, _QUANTIZE_FFN, me, f, f_room):
        _projection_phase(counters, _DOWN, me, code_d, down, f_room, o, x1, out)


@njit(inline="always", cache=True, nogil=True)
def _norm_phase(counters, phase, me, x, w, eps, out, room):
    """Each token of x rmsnormed into out and quantized into room -> False if the team failed."""
    return _token_phase(counters, phase, me, x, w, eps, out, room, True)


@njit(inline="always", cache=True, nogil=True)
def _quantize_phase(counters, phase, me, x, room):
    """Each token of x quantized into room -> False if the team failed."""
    return _token_phase(counters, phase, me, x, _NONE, 0.0, x, room, False)


@njit(inline="always", cache=True, nogil=True)
def _token_phase(counters, phase, me, x, w, eps, out, room, normed):
    """Each token of x (rmsnormed into out first where `normed`) quantized into room, the tokens of an
    item on one thread (decode_lanes.tokens_per_thread) -> False if the team failed."""
    n = x.shape[0]
    per = decode_lanes.tokens_per_thread(room[4])
    items = _items(n, per)
    c = claim(counters, phase, me, items)
    while c < items:
        for i in range(c * per, min(n, (c + 1) * per)):
            if normed:
                _NORM_SERIAL(x[i:i + 1], w, eps, out[i:i + 1])
            _quantize_into(out, i, room)
        finish(counters, phase)
        c = claim(counters, phase, me, items)
    return wait(counters, phase, items)


@njit(inline="always", cache=True, nogil=True)
def _items(n, per):
    return (n + per - 1) // per


@njit(inline="always", cache=True, nogil=True)
def _projection_phase(counters, phase, me, code, w, room, product, residual, out):
    """out = residual + the tokens in room times w, a row group an item (no wait: the caller waits
    where it reads the result)."""
    c = claim(counters, phase, me, _groups(w.shape[0]))
    while c < _groups(w.shape[0]):
        _group_rows(code, w, c, room, product)
        _add_rows(residual, product, c, out)
        finish(counters, phase)
        c = claim(counters, phase, me, _groups(w.shape[0]))


@njit(inline="always", cache=True, nogil=True)
def _add_bias(row, bias):
    for j in range(row.shape[0]):
        row[j] += bias[j]
