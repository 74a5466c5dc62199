"""The routed experts of a MoE layer on the GPU (Ops.expert_ffn): each expert multiplies all the
step's tokens routed to it in one matmul chain, and a scatter kernel adds its weighted rows into the
layer's output. Within one expert the tokens are distinct, so the scatter has no conflicting writes;
experts run one after another in expert order, so the sum's order is the host default's."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numba import cuda

from ember.kernels.cuda.device import flat_grid
from ember.kernels.cuda.device_array import DeviceArray, zeros
from ember.kernels.ops import Array, ExpertWeights, Ops


@cuda.jit
def _scatter_add(out, y, tokens, weights):  # type: ignore[no-untyped-def]
    width = out.shape[1]
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        p, c = i // width, i % width
        out[tokens[p], c] += weights[p] * y[p, c]


def expert_ffn(ops: Ops, x: DeviceArray, experts: Mapping[int, ExpertWeights], token: np.ndarray, expert: np.ndarray,
               weight: np.ndarray, decode_rows: Array | None) -> DeviceArray:
    out = zeros(x.shape)
    order = np.argsort(expert, kind="stable")
    bounds = np.flatnonzero(np.diff(expert[order])) + 1
    for group in np.split(order, bounds) if order.size else ():
        w = experts[int(expert[group[0]])]
        rows = ops.to_device(np.ascontiguousarray(token[group], np.int64))
        flags = None if decode_rows is None else decode_rows[rows]
        y = ops.matmul((ops.geglu_matmul if w.gelu else ops.swiglu_matmul)(x[rows], w.gate, w.up, flags), w.down, flags)
        scale = ops.to_device(np.ascontiguousarray(weight[group], np.float32))
        _scatter_add[flat_grid(y.size)](out.raw, y.raw, rows.raw, scale.raw)
    return out
