"""Greedy decode bursts in one compiled call: the CPU backend's ops.greedy_plan / ops.greedy_burst.

A decode burst (daemon/engine/decode_burst.py) runs several decode steps in a row, each step's
sampled tokens the next one's input. Run from Python, each step is ~15 calls around the compiled
layers: the next step's arrays (StepBatch.following), the embedding, the fused layers' dispatch,
the final norm and output projection, the argmax, the burst's bookkeeping. Right after the kernels
that Python runs several times slower than at rest (docs/runtime.md): on the 12 MB demo model it was
~110 us of a ~900 us token. Where every sequence of the burst samples greedily (no penalties, no
logprobs), nothing in a step needs Python, so here the whole burst is one compiled loop: embedding,
every layer (decoder_layer's thread team; a MoE layer's routed FFN after it, expert_ffn.routed_finish,
while every expert is hot), the final rmsnorm, the output projection and each row's
argmax, then the next position's KV slot, until every sequence has met one of its stop ids or the
burst is over.

The numbers are the per-step path's, bit for bit: the loop calls the compiled functions
ModelRunner.decode's steps reach through the ops (the embedding's row gather, decoder_layer's team,
rmsnorm and integer matmul, each twin's variant picked by the same rule; the team with one member
where run_stack would run the serial layer, whose numbers the team's are), so a sequence gets the
tokens single steps would give it (tests/test_greedy_decode.py compares the logits of every step
bit for bit).

numba links a copy of every function a compiled function calls into its library and keeps that
library's LLVM module in memory once loaded: this loop's code costs the process ~10-25 MB the first
time a burst runs, once, whatever the model.

A plan holds what a model's layers and one KV cache give the loop, as a numba typed List of
per-layer tuples: a model of any depth is one compiled signature, so the kernel cache holds it.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit, typed

from ember.kernels.cpu import twin
from ember.kernels.cpu.decoder_layer import FusedLayer, _layer_alone, _layer_team, _matmul_int8, _parallel, _rmsnorm
from ember.kernels.cpu.expert_ffn import FusedRouted, no_routed_layer, routed_finish
from ember.kernels.cpu.paged_attention import KVLayerStore
from ember.kernels.cpu.quant_matmul import _GATHER_ROWS, INT8_PARALLEL_MIN_WORK, CpuWeight, _read_only
from ember.kernels.cpu.twin import PARALLEL_MIN_WORK

__all__ = ["GreedyPlan", "burst", "embedding_views", "lookup_burst", "plan", "take_argmax"]

_GATHER_SERIAL, _GATHER_PARALLEL = _GATHER_ROWS.serial, _GATHER_ROWS.parallel


@dataclass(frozen=True)
class GreedyPlan:
    """A whole model's decode step over one KV cache, as the compiled loop takes it."""

    # per layer: attn_in, attn_out, work, KV mode, k f32, k u16, k i8, k scales, v f32, v u16, v i8, v scales,
    # whether a routed FFN finishes it, and that FFN's routed_finish arguments (no_routed_layer's stand-ins if none)
    items: list[tuple[Any, ...]]
    embed: tuple[Any, ...]  # the embedding's code, u8, i8, u16, u32 and f32 (empty unless F32) views, columns
    norm: np.ndarray  # the final rmsnorm's weight, float32
    eps: float
    head: tuple[int, np.ndarray]  # the output projection's type code and bytes (an integer decode type)
    vocab: int

    @functools.cached_property
    def layers(self) -> Any:
        """items as the numba typed List the loop takes, built by cached compiled code at the first
        burst (typed.List's own methods compile per process: 1.6 s), not by plan(): a plan is made
        where the first tier of kernels alone may run (kernel_tiers.py), which has no such code."""
        layers = _new_list(self.items[0])
        for item in self.items[1:]:
            _append(layers, item)
        return layers


def plan(fused: Sequence[FusedLayer], embed: CpuWeight, norm: np.ndarray, eps: float, head: CpuWeight,
         ks: Sequence[KVLayerStore], vs: Sequence[KVLayerStore],
         routed: Sequence[FusedRouted | None] = ()) -> GreedyPlan | None:
    """The plan for these layers over these KV stores (layer i finished by routed[i] where given: a
    MoE layer), or None where the per-step path computes what this loop does not: an output projection
    without integer decode kernels (F16, BF16, F32)."""
    if not head.int8:
        return None
    parts = list(routed) + [None] * (len(fused) - len(routed))
    none = no_routed_layer(embed.cols)
    items = [(layer.attn_in, layer.attn_out, layer.work, k.mode, k.f32, k.u16, k.i8, k.scales, v.f32, v.u16, v.i8,
              v.scales, part is not None, *(none if part is None else part.args))
             for layer, k, v, part in zip(fused, ks, vs, parts, strict=True)]
    return GreedyPlan(items, embedding_views(embed), np.ascontiguousarray(norm, np.float32), float(eps),
                      (head.code, head.u8), head.rows)


def embedding_views(w: CpuWeight) -> tuple[Any, ...]:
    """An embedding table as _embedding takes it: its code, u8, i8, u16, u32 and f32 views (an empty
    read-only f32 unless it is F32, as an F32 embedding's rows are: one compiled signature either
    way), columns."""
    f32 = w.f32 if w.f32 is not None else _read_only(np.empty((0, w.cols), np.float32))
    return w.code, w.u8, w.i8, w.u16, w.u32, f32, w.cols


def burst(p: GreedyPlan, steps: int, ids: np.ndarray, positions: np.ndarray, kv_blocks: np.ndarray,
          kv_offsets: np.ndarray, tables: np.ndarray, token_seq: np.ndarray, block_size: int, stops: np.ndarray,
          logits: np.ndarray | None = None) -> np.ndarray:
    """Up to `steps` greedy decode steps of one token per sequence: ids, positions, kv_blocks and
    kv_offsets as the first step's StepBatch has them (every row a decode row, token i of sequence
    token_seq[i]); stops [n, m]: each row's stop ids (-1 pads). -> tokens [steps taken, n]: the burst
    ends once every row has met a stop id; a row that has keeps its stop token as its input, as
    BurstBlocks does. logits (float32 [steps, n, vocab]), if given, receives each step's logits."""
    n = ids.shape[0]
    tokens = np.empty((steps, n), np.int64)
    keep = np.empty((0, n, p.vocab), np.float32) if logits is None else logits
    taken = _burst(steps, twin.threads(), twin.force_code(), np.ascontiguousarray(ids, np.int64),
                   np.ascontiguousarray(positions, np.int64), np.ascontiguousarray(kv_blocks, np.int64),
                   np.ascontiguousarray(kv_offsets, np.int64), tables, np.ascontiguousarray(token_seq, np.int32),
                   block_size, np.ascontiguousarray(stops, np.int64), *p.embed, p.layers, p.norm, p.eps, *p.head,
                   tokens, keep)
    return tokens[:taken]


@njit(cache=True, nogil=True)
def _burst(steps, threads, force, ids, positions, kv_blocks, kv_offsets, tables, token_seq, block_size, stops,
           e_code, e_u8, e_i8, e_u16, e_u32, e_f32, e_cols, layers, norm, eps, h_code, h_u8, tokens, keep):
    n = ids.shape[0]
    ids, positions = ids.copy(), positions.copy()
    kv_blocks, kv_offsets = kv_blocks.copy(), kv_offsets.copy()
    done = np.zeros(n, np.bool_)
    for step in range(steps):
        if step:  # StepBatch.following: one position further on, in the blocks the tables hold
            for i in range(n):
                positions[i] += 1
                kv_blocks[i] = tables[token_seq[i], positions[i] // block_size]
                kv_offsets[i] = positions[i] % block_size
        out = _logits(threads, force, ids, positions, kv_blocks, kv_offsets, tables, token_seq, e_code, e_u8, e_i8,
                      e_u16, e_u32, e_f32, e_cols, layers, norm, eps, h_code, h_u8)
        if keep.shape[0]:
            keep[step] = out
        if take_argmax(out, step, tokens, ids, done, stops):
            return step + 1
    return steps


@njit(inline="always", cache=True, nogil=True)
def _logits(threads, force, ids, positions, kv_blocks, kv_offsets, tables, token_seq, e_code, e_u8, e_i8, e_u16, e_u32,
            e_f32, e_cols, layers, norm, eps, h_code, h_u8):
    """One forward pass of rows ids (row i token_seq[i]'s, at positions[i], its K/V into slot kv_offsets[i]
    of block kv_blocks[i]; each row attends to its sequence's keys up to its own position) -> logits
    [rows, vocab]: what the per-step path computes for them."""
    n = ids.shape[0]
    rows = e_u8.shape[0] if e_f32.shape[0] == 0 else e_f32.shape[0]
    for i in range(n):
        if ids[i] < 0 or ids[i] >= rows:
            raise IndexError("token id out of the embedding's range")
    x = _embedding(ids, e_code, e_u8, e_i8, e_u16, e_u32, e_f32, e_cols, force)
    for k in range(len(layers)):
        layer = layers[k]
        attn_in, attn_out, work, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc = layer[:12]
        # run_stack's choice of threads; the team's phases on this thread alone where it would run the
        # serial _layer_stored_kv, whose numbers they are (calling that too would double this library: +15 MB)
        if threads > 1 and (force == 2 or (force == 0 and work * n >= INT8_PARALLEL_MIN_WORK)):
            x = _layer_team(threads, x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc,
                            kv_blocks, kv_offsets, tables, token_seq, positions, attn_in, attn_out)
        else:
            x = _layer_alone(x, positions, mode, k_f32, k_u16, k_i8, k_sc, v_f32, v_u16, v_i8, v_sc, kv_blocks,
                             kv_offsets, tables, token_seq, positions, attn_in, attn_out)
        if layer[12]:
            x = routed_finish(x, force, *layer[13:])
    h = np.empty_like(x)
    _rmsnorm(x, norm, eps, h, force)
    out = np.empty((n, h_u8.shape[0]), np.float32)
    _matmul_int8(h_code, h_u8, h, out, force)
    return out


def lookup_burst(p: GreedyPlan, budget: int, k: int, min_n: int, max_n: int, history: np.ndarray, length: int,
                 position: int, tables: np.ndarray, token_seq: np.ndarray, block_size: int, stops: np.ndarray
                 ) -> tuple[np.ndarray, int, int, int]:
    """Greedy decoding of one sequence with n-gram proposals verified in the same compiled loop: each
    round looks the sequence's last max_n..min_n tokens up earlier in history[:length] (its tokens; the
    last one, the round's input, at `position`), runs it and up to k tokens that followed them as rows
    of one pass, and keeps each row's argmax while the one before it matched its proposal
    (ngram_proposer.continuation's proposals, verify's rule for greedy requests). Until `budget` tokens
    or a stop id (stops [m], -1 pads): no round's rows go past position + budget - 1, the slots the
    scheduler reserved. tables [1, width] and token_seq (int, [1]): the first step's. history needs room
    for budget more tokens: the accepted ones are written there. -> (the tokens, in order; rounds that
    verified proposals; tokens proposed; proposals accepted): the tokens plain greedy steps would give."""
    out = np.empty(budget, np.int64)
    count, rounds, proposed, accepted = _lookup_burst(
        budget, k, min_n, max_n, twin.threads(), twin.force_code(), history, length, position, tables,
        token_seq.dtype.type(0), block_size, np.ascontiguousarray(stops, np.int64), *p.embed, p.layers, p.norm,
        p.eps, *p.head, out)
    return out[:count], rounds, proposed, accepted


@njit(cache=True, nogil=True)
def _lookup_burst(budget, k, min_n, max_n, threads, force, history, length, position, tables, seq0, block_size, stops,
                  e_code, e_u8, e_i8, e_u16, e_u32, e_f32, e_cols, layers, norm, eps, h_code, h_u8, out):
    count = rounds = proposed = accepted = 0
    proposals = np.empty(max(k, 1), np.int64)
    while count < budget:
        m = _continuation(history, length, min_n, max_n, min(k, budget - count - 1), proposals)
        n = m + 1
        ids, positions = np.empty(n, np.int64), np.empty(n, np.int64)
        kv_blocks, kv_offsets = np.empty(n, np.int64), np.empty(n, np.int64)
        token_seq = np.full(n, seq0)
        ids[0] = history[length - 1]
        ids[1:] = proposals[:m]
        for j in range(n):
            positions[j] = position + j
            kv_blocks[j] = tables[0, positions[j] // block_size]
            kv_offsets[j] = positions[j] % block_size
        logits = _logits(threads, force, ids, positions, kv_blocks, kv_offsets, tables, token_seq, e_code, e_u8, e_i8,
                         e_u16, e_u32, e_f32, e_cols, layers, norm, eps, h_code, h_u8)
        if m:  # a verification pass (a round without proposals is a plain step)
            rounds += 1
        proposed += m
        for j in range(n):
            best = np.argmax(logits[j])
            out[count] = best
            history[length] = best
            count += 1
            length += 1
            position += 1
            for s in range(stops.shape[0]):
                if stops[s] == best:
                    return count, rounds, proposed, accepted
            if j == m or best != proposals[j]:
                break  # the row after a rejected proposal read a token the sequence does not have
            accepted += 1
    return count, rounds, proposed, accepted


@njit(cache=True, nogil=True)
def _continuation(tokens, size, min_n, max_n, k, out):
    """ngram_proposer.continuation on tokens[:size], into out -> how many (the same tokens)."""
    if k <= 0:
        return 0
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for s in range(size - n - 1, -1, -1):  # the latest start first
            same = True
            for j in range(n):
                if tokens[s + j] != tokens[size - n + j]:
                    same = False
                    break
            if same:
                back = size - n - s
                for i in range(k):
                    out[i] = tokens[size - back + i] if i < back else out[i - back]
                return k
    return 0


@njit(inline="always", cache=True, nogil=True)
def take_argmax(logits, step, tokens, ids, done, stops):
    """Each row's argmax into tokens[step] and, unless its block has ended (it keeps its stop token
    as input), into ids, marking the rows that met a stop id -> whether every row has."""
    for i in range(logits.shape[0]):
        best = np.argmax(logits[i])
        tokens[step, i] = best
        if done[i]:
            continue
        ids[i] = best
        for s in range(stops.shape[1]):
            if stops[i, s] == best:
                done[i] = True
    return done.all()


@njit(cache=True, nogil=True)
def _new_list(item):
    layers = typed.List()
    layers.append(item)
    return layers


@njit(cache=True, nogil=True)
def _append(layers, item):
    layers.append(item)


@njit(cache=True, nogil=True)
def _embedding(ids, code, u8, i8, u16, u32, f32, cols, force):
    """quant_matmul.embedding: the rows of ids, dequantized, by the variant its pick would take."""
    out = np.empty((ids.shape[0], cols), np.float32)
    if f32.shape[0]:
        for i in range(ids.shape[0]):
            out[i] = f32[ids[i]]
        return out
    if _parallel(force, ids.shape[0] * cols, PARALLEL_MIN_WORK):
        _GATHER_PARALLEL(code, u8, i8, u16, u32, ids, out)
    else:
        _GATHER_SERIAL(code, u8, i8, u16, u32, ids, out)
    return out
