"""A MoE layer's routed experts for a decode step in one compiled call (the CPU's ops.expert_ffn), and,
where every expert is hot, its router, routing and experts in one (ops.routed_ffn).

The ops API's default expert_ffn calls two kernels per expert from Python, plus the gathers and the
weighted sum around them (~40 Python calls per expert): on a small MoE model that host work, not the
weights, bounded decode (0.26x llama.cpp on the trained MoE demo). Here one numba function runs every
expert group of the step. The experts' matrices reach it as a table of (type code, address, rows,
row bytes) — the hot experts are whichever views of the file the layer holds, so no stacked array
exists to pass — read back as arrays in compiled code; the table is rebuilt from the weights on every
call, so they are alive (the caller holds them) while the kernel reads them.

The numbers are the default's bit for bit: the same grouping (experts in order, tokens in pair order),
the same integer kernels in the variant the op would pick (twin.py), and the weighted sum in the same
float32 operations, without fast-math. A token's result is the same whether its step ran here (every
row a decode row) or through the default (a step with prompt rows). routed_ffn's compiled form calls
the router's kernel the op would (float32 tiles, or the integer one), routing.route_rows, which the
op calls too, and the same groups.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from ember.kernels.cpu import twin
from ember.kernels.cpu.decoder_layer import _f32, _matmul_int8, _parallel, _rmsnorm, gated_ffn
from ember.kernels.cpu.quant_matmul import _FLOAT_TILE_TOKENS, _MATMUL_F32, INT8_PARALLEL_MIN_WORK, CpuWeight
from ember.kernels.cpu.quant_matmul import _read_only as _read_only_view
from ember.kernels.cpu.twin import PARALLEL_MIN_WORK
from ember.kernels.cpu.routing import route_rows
from ember.kernels.ops import ExpertWeights, Routing

__all__ = ["ExpertTable", "FusedRouted", "expert_ffn", "expert_table", "fuse_routed", "routed_ffn"]

_NO_BIAS = np.zeros(0, np.float32)
_F32_SERIAL, _F32_PARALLEL = _MATMUL_F32.serial, _MATMUL_F32.parallel


@dataclass(frozen=True)
class ExpertTable(Mapping):
    """A layer's hot experts as the compiled path reads them: the table's row e is expert e's
    (_row), all zeros for an expert that is not hot; `complete` when every expert is hot and takes
    the integer kernels. It holds the weights, so the addresses stay valid while it lives, and is
    the mapping expert id -> weights itself, for the ops that take one."""

    experts: Mapping[int, ExpertWeights]
    rows: np.ndarray  # int64 [n_experts, 12]
    complete: bool

    def __getitem__(self, e: int) -> ExpertWeights:
        return self.experts[e]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.experts)

    def __len__(self) -> int:
        return len(self.experts)


def expert_table(experts: Mapping[int, ExpertWeights], n_experts: int) -> ExpertTable:
    held = dict(experts)
    rows = np.zeros((n_experts, 12), np.int64)
    complete = len(held) == n_experts and not any(ws.gelu for ws in held.values())  # the kernels gate with SiLU
    for e, ws in held.items():
        row = _row(ws)
        if row is None:
            complete = False
        else:
            rows[e] = row
    return ExpertTable(held, rows, complete)


def routed_ffn(x: np.ndarray, router: CpuWeight, table: ExpertTable, routing: Routing) -> tuple[np.ndarray, np.ndarray]:
    """ops.routed_ffn for a step of decode rows whose layer has every expert hot (table.complete) and
    a float32 or integer-kernel router."""
    n, k = x.shape[0], routing.k
    out = np.zeros(x.shape, np.float32)
    ids, weights = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
    _routed(np.ascontiguousarray(x, np.float32), *_router_args(router, routing), table.rows, twin.force_code(), out,
            ids, weights)
    return out, ids


def _router_args(router: CpuWeight, routing: Routing) -> tuple[Any, ...]:
    """_routed's router and routing arguments (f32, code, u8, k, normalize, sigmoid, bias, softcap,
    scale): a float32 router's rows, or an empty read-only stand-in beside an integer one's bytes (one
    numba type either way)."""
    f32 = router.f32 if router.f32 is not None else _read_only_view(np.zeros((0, router.cols), np.float32))
    bias = _NO_BIAS if routing.bias is None else np.array(routing.bias, np.float32)
    return (f32, router.code, router.u8, routing.k, routing.normalize, routing.gating == "sigmoid", bias,
            np.float32(routing.softcap), np.float32(routing.scale))



@dataclass(frozen=True)
class FusedRouted:
    """A MoE layer's FFN after its fused attention, in one compiled call (ops.fuse_routed): the norm,
    the router, the routing and every expert (all hot), the residual, and the routing recorded into
    the layer's row of the statistics as RoutingStats.record does. Called as the layer stack's step
    (decoder_layer.run_stack) and the greedy burst's (greedy_decode) run it: args are routed_finish's
    after x and force, arrays of the same numba types for every model (one compiled signature)."""

    args: tuple[Any, ...]

    def __call__(self, x: np.ndarray, force: int) -> np.ndarray:
        return routed_finish(x, force, *self.args)


def fuse_routed(norm: np.ndarray, eps: float, router: CpuWeight, table: ExpertTable, routing: Routing,
                counts: np.ndarray, half_life: float, routed: np.ndarray,
                shared: ExpertWeights | None = None) -> FusedRouted | None:
    """The layer's FFN as FusedRouted, or None where routed_ffn's compiled form does not take it (an
    expert not hot or without integer kernels, a 16-bit router). counts: the layer's float64 row of
    RoutingStats.counts (updated in place); routed: an int64 [1] count of routed pairs, added to;
    shared: an ungated shared expert every token also goes through (Laguna's), added to the routed sum."""
    if not table.complete or not (router.int8 or router.f32 is not None):
        return None
    if shared is not None and _row(shared) is None:
        return None
    return FusedRouted((_f32(norm), float(eps), *_router_args(router, routing), table.rows, counts, float(half_life),
                        routed, *_shared_args(shared, router.cols)))


def _shared_args(shared: ExpertWeights | None, cols: int) -> tuple[Any, ...]:
    """routed_finish's shared-expert arguments: whether there is one, its matrices' codes and bytes."""
    if shared is None:
        none = _read_only_view(np.zeros((0, cols), np.uint8))
        return (False, 0, none, 0, none, 0, none)
    g, u, d = shared.gate, shared.up, shared.down
    return (True, g.code, g.u8, u.code, u.u8, d.code, d.u8)


def no_routed_layer(cols: int) -> tuple[Any, ...]:
    """FusedRouted.args' stand-ins for a layer without routed experts: the same numba types, never read."""
    return (_NO_BIAS, 0.0, _read_only_view(np.zeros((0, cols), np.float32)), 0,
            _read_only_view(np.zeros((0, cols), np.uint8)), 0, False, False, _NO_BIAS, np.float32(0), np.float32(1),
            np.zeros((0, 12), np.int64), np.zeros(0, np.float64), 1.0, np.zeros(1, np.int64), *_shared_args(None, cols))


def expert_ffn(x: np.ndarray, experts: Mapping[int, ExpertWeights], token: np.ndarray, expert: np.ndarray,
               weight: np.ndarray) -> np.ndarray | None:
    """ops.expert_ffn for a step whose rows are all decode rows; None, having done nothing, if an
    expert's matrices do not all take the integer kernels, or its experts gate differently (SiLU and
    GELU: the default then runs it)."""
    out = np.zeros(x.shape, np.float32)
    if expert.size == 0:
        return out
    order = np.argsort(expert, kind="stable")
    sorted_experts = expert[order]
    firsts = np.concatenate(([0], np.flatnonzero(np.diff(sorted_experts)) + 1))
    chosen = [experts[int(e)] for e in sorted_experts[firsts]]
    rows = [_row(ws) for ws in chosen]
    gelu = {ws.gelu for ws in chosen}
    if None in rows or len(gelu) > 1:
        return None
    table = np.array(rows, np.int64)
    _groups(np.ascontiguousarray(x, np.float32), table, np.append(firsts, order.size),
            np.ascontiguousarray(token[order], np.int64), np.ascontiguousarray(weight[order], np.float32),
            twin.force_code(), out, gelu.pop())
    return out


def _row(ws: ExpertWeights) -> tuple[int, ...] | None:
    """An expert's row of the table, or None where the default computes it with other kernels."""
    g, u, d = ws.gate, ws.up, ws.down
    if not (g.int8 and u.int8 and d.int8 and (g.rows, g.cols) == (u.rows, u.cols)):
        return None
    return (g.code, g.address, *g.u8.shape, u.code, u.address, *u.u8.shape, d.code, d.address, *d.u8.shape)


@intrinsic
def _u8_pointer(typingctx, address):
    """The uint8 pointer at an integer address."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.CPointer(types.uint8)(address), codegen


@intrinsic
def _read_only(typingctx, array):
    """The same array typed read-only, as the dense layers' weights (views of the mmap'd file) are:
    the integer kernels then take one signature for both, compiled once (not twice, ~40 s)."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return impl_ret_borrowed(context, builder, sig.return_type, args[0])

    return array.copy(readonly=True)(array), codegen


@njit(inline="always", cache=True, nogil=True)
def _matrix(table, g, k):
    """Matrix k (gate 0, up 1, down 2) of group g as uint8 [rows, row bytes] over the file's bytes."""
    return _read_only(numba.carray(_u8_pointer(table[g, 4 * k + 1]), (table[g, 4 * k + 2], table[g, 4 * k + 3])))


@njit(cache=True, nogil=True)
def _routed(x, f32, code, u8, k, normalize, sigmoid, bias, softcap, scale, table, force, out, ids, weights):
    """The router's logits (as ops.matmul computes them for decode rows), routing.route_rows, then the
    pairs grouped by expert in pair order (expert_ffn's stable argsort) through _groups."""
    n, d = x.shape
    n_experts = table.shape[0]
    logits = np.empty((n, n_experts), np.float32)
    if f32.shape[0]:  # quant_matmul._tiled: tokens padded to whole tiles
        padded = np.zeros((n + (-n) % _FLOAT_TILE_TOKENS, d), np.float32)
        padded[:n] = x
        tiled = np.empty((padded.shape[0], n_experts), np.float32)
        if _parallel(force, f32.size * padded.shape[0], PARALLEL_MIN_WORK):  # _MATMUL_F32.pick's choice
            _F32_PARALLEL(f32, padded, tiled)
        else:
            _F32_SERIAL(f32, padded, tiled)
        logits[:] = tiled[:n]
    else:
        _matmul_int8(code, u8, x, logits, force)
    route_rows(logits, k, normalize, sigmoid, bias, softcap, scale, ids, weights)
    counts = np.zeros(n_experts + 1, np.int64)
    for t in range(n):
        for r in range(k):
            counts[ids[t, r] + 1] += 1
    groups = 0
    for e in range(n_experts):
        groups += counts[e + 1] > 0
        counts[e + 1] += counts[e]  # now the first slot of each expert's pairs
    sub = np.empty((groups, table.shape[1]), np.int64)
    bounds = np.empty(groups + 1, np.int64)
    g = 0
    for e in range(n_experts):
        if counts[e + 1] > counts[e]:
            sub[g] = table[e]
            bounds[g] = counts[e]
            g += 1
    bounds[groups] = n * k
    token = np.empty(n * k, np.int64)
    weight = np.empty(n * k, np.float32)
    for t in range(n):
        for r in range(k):
            slot = counts[ids[t, r]]
            counts[ids[t, r]] += 1
            token[slot], weight[slot] = t, weights[t, r]
    _groups(x, sub, bounds, token, weight, force, out, False)  # a complete table's experts gate with SiLU


@njit(cache=True, nogil=True)  # no fast-math: the statistics round as numpy's
def routed_finish(x, force, norm, eps, f32, code, u8, k, normalize, sigmoid, bias, softcap, scale, table, counts,
                  half_life, routed, has_shared, code_g, gate, code_u, up, code_d, down):
    """x + the routed FFN of rmsnorm(x) (+ the shared expert's, where has_shared), as Block.finish
    computes it through ops.rmsnorm, routed_ffn and (SharedExpertMoE) swiglu_matmul and matmul, with
    the chosen experts recorded as RoutingStats.record and ExpertManager.record do."""
    n = x.shape[0]
    h = np.empty_like(x)
    _rmsnorm(x, norm, eps, h, force)
    out = np.zeros(x.shape, np.float32)
    ids, weights = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
    _routed(h, f32, code, u8, k, normalize, sigmoid, bias, softcap, scale, table, force, out, ids, weights)
    decay = 0.5 ** (n / half_life)
    tally = np.zeros(counts.shape[0], np.int64)
    for t in range(n):
        for r in range(k):
            tally[ids[t, r]] += 1
    for e in range(counts.shape[0]):
        counts[e] *= decay
        counts[e] += tally[e]
    routed[0] += n * k
    if has_shared:
        out = out + gated_ffn(code_g, gate, code_u, up, code_d, down, h, force, False)
    return x + out


@njit(cache=True, nogil=True)  # no fast-math: the weighted sum rounds as numpy's
def _groups(x, table, bounds, token, weight, force, out, gelu):
    """out[token[p]] += weight[p] * expert(x[token[p]]) for the pairs p of each group g (bounds[g] to
    bounds[g + 1], one expert, its matrices in table[g]), group by group; the experts gated by
    GELU-tanh where `gelu` (gemma4's), else by SiLU. Where the parallel kernels would run, two or more
    groups run each on one thread (_experts_apart) instead."""
    groups, d = table.shape[0], x.shape[1]
    y = np.empty((bounds[groups], d), np.float32)  # each pair's expert output, in pair order
    if groups > 1 and _parallel(force, _work(table, bounds), INT8_PARALLEL_MIN_WORK):
        _experts_apart(x, table, bounds, token, gelu, y)
    else:
        for g in range(groups):
            _expert(x, table, bounds, token, g, force, gelu, y)
    for p in range(bounds[groups]):  # the pairs in group order, as the sum always ran
        w, t = weight[p], token[p]
        for j in range(d):
            out[t, j] += y[p, j] * w


# A decode step's groups take one parallel region, not two a group: each group's expert on one thread,
# serial, where before every expert's gate/up and down were split across the threads, a parallel
# region each (~1.5-4 us to wake and join the threads on the 2-core VM, 16 a layer of top-8 routing,
# against ~0.1 ms of its experts' bytes at memory speed). The kernels' variants give the same bits
# (twin.py), so which thread computes a group never changes its result.
@njit(parallel=True, cache=True, nogil=True)
def _experts_apart(x, table, bounds, token, gelu, y):
    """_expert for every group, the groups spread over the threads."""
    for g in prange(table.shape[0]):
        _expert(x, table, bounds, token, g, 1, gelu, y)


@njit(cache=True, nogil=True)
def _expert(x, table, bounds, token, g, force, gelu, y):
    """y's rows of group g's pairs: its expert (table[g]) applied to their tokens' rows of x."""
    first, n = bounds[g], bounds[g + 1] - bounds[g]
    xt = np.empty((n, x.shape[1]), np.float32)
    for i in range(n):
        xt[i] = x[token[first + i]]
    y[first:first + n] = gated_ffn(table[g, 0], _matrix(table, g, 0), table[g, 4], _matrix(table, g, 1), table[g, 8],
                                   _matrix(table, g, 2), xt, force, gelu)


@njit(inline="always", cache=True, nogil=True)
def _work(table, bounds):
    """The step's expert work as the parallel kernels count it: each group's matrices' bytes times its tokens."""
    total = 0
    for g in range(table.shape[0]):
        total += (table[g, 2] * table[g, 3] + table[g, 6] * table[g, 7] + table[g, 10] * table[g, 11]) * (
            bounds[g + 1] - bounds[g])
    return total
