"""CPU dense kernels (rmsnorm, rope, swiglu, softmax) against the numpy reference."""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.reference import dense as reference
from ember.kernels.cpu import dense, twin

rng = np.random.default_rng(0)


@pytest.fixture(autouse=True, params=["serial", "parallel"])
def kernel_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test against both compiled variants of each kernel."""
    monkeypatch.setattr(twin, "FORCE", request.param)


def randn(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(1, 8), (5, 384), (3, 4, 64), (2, 7)])
def test_rmsnorm(shape: tuple[int, ...]) -> None:
    x, w = randn(*shape), randn(shape[-1])
    np.testing.assert_allclose(dense.rmsnorm(x, w, 1e-6), reference.rmsnorm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("n,heads,hd", [(1, 1, 2), (5, 3, 64), (17, 2, 128)])
def test_rope(interleaved: bool, n: int, heads: int, hd: int) -> None:
    x = randn(n, heads, hd)
    positions = rng.integers(0, 100_000, n)
    inv_freq = (10000.0 ** (-np.arange(0, hd, 2) / hd)).astype(np.float32)
    expected = reference.rope(x, positions, inv_freq, interleaved)
    np.testing.assert_allclose(dense.rope(x.copy(), positions, inv_freq, interleaved), expected, atol=2e-5)


def test_rope_layouts_differ() -> None:
    x = randn(2, 1, 8)
    pos, inv = np.array([3, 9]), np.ones(4, np.float32)
    assert not np.allclose(dense.rope(x.copy(), pos, inv, True), dense.rope(x.copy(), pos, inv, False))


def test_swiglu_and_softmax() -> None:
    g, u = randn(3, 37), randn(3, 37)
    np.testing.assert_allclose(dense.swiglu(g, u), reference.swiglu(g, u), rtol=1e-5, atol=1e-6)
    x = randn(4, 1000) * 20
    np.testing.assert_allclose(dense.softmax(x), reference.softmax(x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_qk_norm_rope_equals_norms_then_rope(normed: bool, interleaved: bool) -> None:
    """The fused kernel against the numpy reference of its parts: per-head rmsnorm (qwen3's q/k norms,
    when the model has them), then rope, on q [n, 6, 64] and k [n, 2, 64]."""
    n, hd = 5, 64
    q, k = randn(n, 6, hd), randn(n, 2, hd)
    qn, kn = (randn(hd), randn(hd)) if normed else (None, None)
    positions = np.array([0, 3, 7, 100, 40000])
    inv_freq = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    want_q, want_k = (reference.rmsnorm(q, qn, 1e-6), reference.rmsnorm(k, kn, 1e-6)) if normed else (q, k)
    want_q, want_k = (reference.rope(x, positions, inv_freq, interleaved) for x in (want_q, want_k))
    got_q, got_k = dense.qk_norm_rope(q.copy(), k.copy(), qn, kn, 1e-6, positions, inv_freq, interleaved)
    np.testing.assert_allclose(got_q, want_q, rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(got_k, want_k, rtol=1e-5, atol=3e-5)


def test_one_kernel_thread_runs_the_serial_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """By the work, a twin runs parallel; on one thread it runs serial (faster there), compiled code too."""
    import numba

    monkeypatch.setattr(twin, "FORCE", None)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert twin.one_thread() and twin.force_code() == 1
        assert dense._RMSNORM.pick(1 << 40) is dense._RMSNORM.serial
        if numba.config.NUMBA_NUM_THREADS > 1:
            numba.set_num_threads(2)
            assert not twin.one_thread() and twin.force_code() == 0
            assert dense._RMSNORM.pick(1 << 40) is dense._RMSNORM.parallel
            assert dense._RMSNORM.pick(1) is dense._RMSNORM.serial
    finally:
        numba.set_num_threads(before)
