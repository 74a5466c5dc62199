"""Gated DeltaNet kernels: the numpy references against transformers' torch fallback (an oracle written
apart from them), the chunked form against the recurrence, and the CPU kernels (serial and parallel)
and the ops API's default implementations against the references, several sequences in one step."""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.cpu import dense, twin
from ember.kernels.cpu.backend import CpuOps
from ember.kernels.ops import Ops
from ember.kernels.reference import dense as ref_dense
from ember.kernels.reference import linear_attention as ref

rng = np.random.default_rng(0)


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def random_heads(n: int, h: int, dk: int, dv: int) -> tuple[np.ndarray, ...]:
    q, k = ref.normalize_qk(randn(n, h, dk), randn(n, h, dk))
    g, beta = ref.gates(randn(n, h), randn(n, h), -np.exp(randn(h)).astype(np.float64), randn(h))
    return q, k, randn(n, h, dv), g, beta, randn(h, dk, dv, scale=0.3)


@pytest.mark.parametrize("n,chunk", [(1, 64), (5, 4), (64, 64), (150, 64), (33, 16)])
def test_chunked_equals_recurrent(n: int, chunk: int) -> None:
    q, k, v, g, beta, state = random_heads(n, 3, 16, 8)
    out_r, s_r = ref.delta_rule_recurrent(q, k, v, g, beta, state)
    out_c, s_c = ref.delta_rule_chunked(q, k, v, g, beta, state, chunk)
    np.testing.assert_allclose(out_c, out_r, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-4, atol=1e-5)


def test_references_match_transformers_torch_fallback() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    n, hk, hv, dk, dv, taps = 23, 2, 4, 16, 8, 4
    qkv, w, a, b = randn(n, 2 * hk * dk + hv * dv), randn(2 * hk * dk + hv * dv, taps, scale=0.5), randn(n, hv), randn(n, hv)
    A, dt_bias, state = -np.exp(randn(hv)), randn(hv), randn(hv, dk, dv, scale=0.3)
    # conv: theirs over the whole sequence from zeros
    conv, window = ref.causal_conv1d(qkv, w, np.zeros((taps - 1, qkv.shape[1]), np.float32))
    theirs = hf.causal_conv1d_fn(torch.tensor(qkv.T[None]), torch.tensor(w), None, activation="silu")[0].T.numpy()
    np.testing.assert_allclose(conv, theirs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(window, qkv[-(taps - 1):])
    # delta rule, grouped value heads (value head j reads key head j // 2), from a given state
    q, k, v = conv[:, : hk * dk].reshape(n, hk, dk), conv[:, hk * dk: 2 * hk * dk].reshape(n, hk, dk), conv[:, 2 * hk * dk:].reshape(n, hv, dv)
    qn, kn = ref.normalize_qk(ref.expand_heads(q, hv, False), ref.expand_heads(k, hv, False))
    g, beta = ref.gates(a, b, A, dt_bias)
    ours, s_ours = ref.delta_rule_chunked(qn, kn, v, g, beta, state, chunk=8)
    t = lambda x: torch.tensor(np.asarray(x, np.float32))[None]  # noqa: E731
    theirs, s_theirs = hf.torch_recurrent_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), initial_state=t(state),
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(ours, theirs[0].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s_ours, s_theirs[0].numpy(), rtol=1e-4, atol=1e-5)


def test_expand_heads_orders() -> None:
    x = np.arange(2)[None, :, None].astype(np.float32)  # key heads 0, 1
    assert ref.expand_heads(x, 4, tiled=False)[0, :, 0].tolist() == [0, 0, 1, 1]
    assert ref.expand_heads(x, 4, tiled=True)[0, :, 0].tolist() == [0, 1, 0, 1]


class Step:
    """A step of several sequences through the ops: runs of given lengths, some continuing a state."""

    def __init__(self, lengths: list[int], starts_at: list[int], hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 8,
                 taps: int = 4, slots: int = 5) -> None:
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.C = 2 * hk * dk + hv * dv
        n = sum(lengths)
        self.seq_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.slots = rng.permutation(slots)[: len(lengths)].astype(np.int64)
        self.positions = np.concatenate([np.arange(p, p + m) for p, m in zip(starts_at, lengths)]).astype(np.int64)
        self.x, self.w = randn(n, self.C), randn(self.C, taps, scale=0.5)
        self.a, self.b = randn(n, hv), randn(n, hv)
        self.A, self.dt_bias = (-np.exp(randn(hv))).astype(np.float32), randn(hv)
        self.conv_states = randn(slots, taps - 1, self.C)
        self.delta_states = randn(slots, hv, dk, dv, scale=0.3)

    def run(self, ops: Ops, tiled: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        conv_states, delta_states = self.conv_states.copy(), self.delta_states.copy()
        mixed = ops.causal_conv1d(self.x, self.w, conv_states, self.seq_starts, self.slots, self.positions)
        out = ops.gated_delta_net(mixed, self.a, self.b, self.A, self.dt_bias, delta_states, self.seq_starts,
                                  self.slots, self.positions, self.hk, self.dk, tiled)
        return mixed, out, conv_states, delta_states

    def expected(self, tiled: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        conv_states, delta_states = self.conv_states.copy(), self.delta_states.copy()
        mixed = np.empty_like(self.x)
        out = np.empty((len(self.x), self.hv, self.dv), np.float32)
        key = self.hk * self.dk
        for s in range(len(self.slots)):
            sl, slot = slice(self.seq_starts[s], self.seq_starts[s + 1]), self.slots[s]
            fresh = self.positions[sl.start] == 0
            window = np.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
            mixed[sl], conv_states[slot] = ref.causal_conv1d(self.x[sl], self.w, window)
            m = mixed[sl]
            q, k = ref.normalize_qk(ref.expand_heads(m[:, :key].reshape(-1, self.hk, self.dk), self.hv, tiled),
                                    ref.expand_heads(m[:, key: 2 * key].reshape(-1, self.hk, self.dk), self.hv, tiled))
            g, beta = ref.gates(self.a[sl], self.b[sl], self.A, self.dt_bias)
            state = np.zeros_like(delta_states[slot]) if fresh else delta_states[slot]
            out[sl], delta_states[slot] = ref.delta_rule_recurrent(q, k, m[:, 2 * key:].reshape(-1, self.hv, self.dv),
                                                                   g, beta, state)
        return mixed, out, conv_states, delta_states


STEPS = {
    "decode": ([1, 1, 1], [5, 0, 17]),
    "prefill": ([130], [0]),
    "mixed": ([1, 70, 3, 1], [9, 0, 40, 0]),
}


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("case", STEPS)
def test_cpu_kernels_match_reference(monkeypatch: pytest.MonkeyPatch, variant: str, tiled: bool, case: str) -> None:
    monkeypatch.setattr(twin, "FORCE", variant)
    step = Step(*STEPS[case])
    for got, want in zip(step.run(CpuOps(), tiled), step.expected(tiled), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


class ReferenceOps(CpuOps):
    """The ops API's default (reference-based) implementations of the linear-attention ops."""

    causal_conv1d = Ops.causal_conv1d
    gated_delta_net = Ops.gated_delta_net
    sigmoid_mul = Ops.sigmoid_mul


@pytest.mark.parametrize("case", ["mixed"])
def test_default_ops_match_reference(case: str) -> None:
    step = Step(*STEPS[case])
    for got, want in zip(step.run(ReferenceOps(), True), step.expected(True), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_sigmoid_mul_and_partial_rope() -> None:
    x, gate = randn(3, 40), randn(3, 40)
    np.testing.assert_allclose(dense.sigmoid_mul(x, gate), ref_dense.sigmoid_mul(x, gate), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ReferenceOps().sigmoid_mul(x, gate), ref_dense.sigmoid_mul(x, gate), rtol=1e-6)
    # partial rotary: 16 of 64 dimensions rotate (halves within them), the other 48 are left alone
    q = randn(4, 2, 64)
    inv = (10000.0 ** (-np.arange(0, 16, 2) / 16)).astype(np.float32)
    pos = np.array([0, 1, 50, 3000])
    got = dense.rope(q.copy(), pos, inv, False)
    np.testing.assert_allclose(got, ref_dense.rope(q, pos, inv, False), atol=2e-5)
    np.testing.assert_array_equal(got[..., 16:], q[..., 16:])
    assert not np.allclose(got[1:, :, :16], q[1:, :, :16])
