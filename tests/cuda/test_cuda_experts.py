"""The routed experts of a MoE layer on the device (Ops.expert_ffn) against the float64 reference:
each expert's tokens gathered, multiplied and added back with their routing weights."""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.ops import ExpertWeights
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference import moe as ref_moe
from ember.kernels.reference.quant import dequantize, quantize
from ember.kernels.tensor_types import TensorType as T

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize(("ttype", "d"), [(T.F16, 64), (T.Q4_K, 256)], ids=["F16", "Q4_K"])
def test_expert_ffn_matches_the_reference(ttype: T, d: int) -> None:
    from ember.kernels.cuda.backend import CudaOps

    ops, rng = CudaOps(), np.random.default_rng(int(ttype))
    n_exp, n, k = 3, 3, 2
    dense, experts = [], {}
    for rows, cols in ((d, d), (d, d), (d, d)):  # gate, up, down; f = d keeps the launches small
        w = rng.standard_normal((n_exp, rows, cols)).astype(np.float32) * 0.1
        data = quantize(ttype, w.reshape(-1, cols)).reshape(n_exp, rows, -1)
        dense.append(np.stack([dequantize(ttype, data[e], cols) for e in range(n_exp)]).astype(np.float64))
        for e in range(n_exp):
            experts.setdefault(e, []).append(ops.weight(RawTensor(f"e{e}", ttype, (rows, cols), data[e])))
    x = rng.standard_normal((n, d)).astype(np.float32)
    ids, w = ref_moe.route(rng.standard_normal((n, n_exp)), k, True)
    token, expert, weight = np.repeat(np.arange(n), k), ids.reshape(-1), w.reshape(-1).astype(np.float32)
    got = ops.to_numpy(ops.expert_ffn(ops.to_device(x), {e: ExpertWeights(*ws) for e, ws in experts.items()},
                                      token, expert, weight))
    expected = ref_moe.moe_ffn(x, *dense, ids, weight.reshape(n, k))
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
