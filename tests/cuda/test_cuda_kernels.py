"""Every CUDA kernel against the numpy reference: quantized matmul and embedding for every weight
type, the dense kernels, greedy argmax, and the paged KV cache (write and attention, decode and
prefill, GQA) for every KV dtype. Shapes are tiny: under the simulator every CUDA thread is a Python
thread."""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.convert import KV_DTYPES, decode_rows, encode_rows, quantize_q8_0_split
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference import dense as ref
from ember.kernels.reference.quant import dequantize, quantize
from ember.kernels.tensor_types import TensorType as T

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    from ember.kernels.cuda.backend import CudaOps

    return CudaOps()


def dev(ops, x):  # type: ignore[no-untyped-def]
    return ops.to_device(np.ascontiguousarray(x))


# (type, columns): K-quants need whole 256-value super-blocks; F32 with a short last chunk
WEIGHTS = [(T.F32, 40), (T.F16, 64), (T.BF16, 96), (T.Q8_0, 64), (T.Q4_K, 256), (T.Q5_K, 256), (T.Q6_K, 512)]


@pytest.mark.parametrize(("ttype", "cols"), WEIGHTS, ids=[t.name for t, _ in WEIGHTS])
def test_matmul_and_embedding_read_every_weight_type(ops, ttype: T, cols: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(int(ttype))
    rows = 5
    data = quantize(ttype, rng.standard_normal((rows, cols)).astype(np.float32))
    w = dequantize(ttype, data, cols)  # what the file's blocks mean
    weight = ops.weight(RawTensor("w", ttype, (rows, cols), data))
    assert ops.weight_rows(weight) == rows
    for n in (1, 6):  # a decode matvec, and a batch spanning two token tiles
        x = rng.standard_normal((n, cols)).astype(np.float32)
        got = ops.to_numpy(ops.matmul(dev(ops, x), weight))
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    ids = np.array([4, 0, 4, 2])
    assert np.array_equal(ops.to_numpy(ops.embedding(weight, ids)), w[ids])  # decoding is exact


def test_rmsnorm_swiglu_softmax(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 40)).astype(np.float32) * 3
    w = rng.standard_normal(40).astype(np.float32)
    np.testing.assert_allclose(ops.to_numpy(ops.rmsnorm(dev(ops, x), dev(ops, w), 1e-5)), ref.rmsnorm(x, w, 1e-5),
                               rtol=1e-5, atol=1e-6)
    g, u = x[0], x[1] * 2
    np.testing.assert_allclose(ops.to_numpy(ops.swiglu(dev(ops, g), dev(ops, u))), ref.swiglu(g, u), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.to_numpy(ops.softmax(dev(ops, x))), ref.softmax(x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary", [16, 8], ids=["full", "partial"])
def test_rope_both_layouts(ops, interleaved: bool, rotary: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 16)).astype(np.float32)
    positions = np.array([0, 7, 100_003])  # far positions need the float64 angle
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    got = ops.to_numpy(ops.rope(dev(ops, x), positions, dev(ops, inv_freq), interleaved))
    np.testing.assert_allclose(got, ref.rope(x, positions, inv_freq, interleaved), rtol=1e-5, atol=1e-5)


def test_qk_norm_rope_matches_its_parts(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 4, 16)).astype(np.float32), rng.standard_normal((2, 2, 16)).astype(np.float32)
    qn, kn = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    positions, inv_freq = np.array([3, 9]), (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    gq, gk = ops.qk_norm_rope(dev(ops, q), dev(ops, k), dev(ops, qn), dev(ops, kn), 1e-6, positions,
                              dev(ops, inv_freq), False)
    np.testing.assert_allclose(ops.to_numpy(gq), ref.rope(ref.rmsnorm(q, qn, 1e-6), positions, inv_freq, False),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ops.to_numpy(gk), ref.rope(ref.rmsnorm(k, kn, 1e-6), positions, inv_freq, False),
                               rtol=1e-5, atol=1e-5)


def test_argmax_rows_takes_the_first_of_equal_maxima(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 45)).astype(np.float32)
    x[1, [7, 30]] = 9.0  # a tie: np.argmax takes the first
    x[3] = -np.inf
    x[3, 44] = -1e30
    rows = np.array([3, 1, 0])
    assert ops.to_numpy(ops.argmax_rows(dev(ops, x), rows)).tolist() == np.argmax(x[rows], axis=1).tolist()


def test_device_arrays_add_and_select_rows(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    da = dev(ops, a)
    assert np.array_equal(ops.to_numpy(da + dev(ops, b)), a + b)  # a bias broadcast
    assert np.array_equal(ops.to_numpy(da + da), a + a)
    assert np.array_equal(ops.to_numpy(da[dev(ops, np.array([2, 0]))]), a[[2, 0]])
    flags = dev(ops, np.array([True, False, True]))
    assert ops.to_numpy(flags[dev(ops, np.array([1, 2]))]).tolist() == [False, True]
    with pytest.raises(ValueError, match="cannot broadcast"):
        da + dev(ops, b[:4])
    assert np.array_equal(ops.to_numpy(1.0 + da), a + np.float32(1))  # a scalar, in the array's dtype
    column = rng.standard_normal((3, 1)).astype(np.float32)  # [n, 1] over [n, d], as a per-row gate
    assert np.array_equal(ops.to_numpy(dev(ops, column) + 0.0 * da), column + np.float32(0) * a)
    assert np.array_equal(ops.to_numpy(da * dev(ops, b)), a * b)


def test_device_array_views_reshape_and_assignment(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(8)
    a = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    both = dev(ops, a)
    second = both[:, :, 1]  # a strided view, as gated attention splits [q | gate] per head
    assert np.array_equal(ops.to_numpy(second.reshape(2, 12)), a[:, :, 1].reshape(2, 12))  # copied, then reshaped
    np.testing.assert_allclose(ops.to_numpy(ops.swiglu(second, both[:, :, 0])), ref.swiglu(a[:, :, 1], a[:, :, 0]),
                               rtol=1e-5, atol=1e-7)
    target = ops.zeros((2, 3, 4))
    target[...] = second
    assert np.array_equal(ops.to_numpy(target), a[:, :, 1]) and target.nbytes == 96
    with pytest.raises(TypeError, match="whole-array assignment"):
        target[0] = second[0]


def test_sigmoid_mul(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(9)
    x, g = rng.standard_normal((3, 10)).astype(np.float32), rng.standard_normal((3, 10)).astype(np.float32) * 4
    np.testing.assert_allclose(ops.to_numpy(ops.sigmoid_mul(dev(ops, x), dev(ops, g))), ref.sigmoid_mul(x, g),
                               rtol=1e-5, atol=1e-7)


def _host_store(store) -> np.ndarray:  # type: ignore[no-untyped-def]
    """A CUDA KV store's rows as host storage in convert.py's layout."""
    from ember.kernels.cuda.paged_attention import MODE

    mode = {v: k for k, v in MODE.items()}[store.mode]
    if mode == "f32":
        return store.f32.copy_to_host()
    if mode in ("f16", "bf16"):
        return store.u16.copy_to_host()
    return np.concatenate([store.scales.copy_to_host()[..., None].view(np.uint8).reshape(*store.scales.shape, 2),
                           store.i8.copy_to_host().view(np.uint8).reshape(*store.scales.shape, 32)], axis=-1)


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_kv_write_stores_the_bytes_convert_py_would(ops, dtype: str) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(6)
    rows = rng.standard_normal((3, 2, 64)).astype(np.float32) * 10
    rows[0, 0, :4] = [1e-8, -3e-6, 70000.0, 0.0]  # a half subnormal, a tiny one, beyond f16's range, zero
    rows[1, 1, 32:] = 0.0  # an all-zero q8_0 block
    store = ops.kv_store(dtype, 4, 2, 2, 64, keys=True)
    blocks, offsets = np.array([3, 0, 3]), np.array([1, 0, 0])
    ops.kv_write(store, blocks, offsets, dev(ops, rows))
    stored = _host_store(store)[blocks, offsets]
    want = encode_rows(rows, dtype)
    if dtype == "q8_0":  # split storage: [scale bits | 32 values] per block, per head
        scales, quants = quantize_q8_0_split(rows)
        want = np.concatenate([scales[..., None].view(np.uint8).reshape(*scales.shape, 2),
                               quants.view(np.uint8).reshape(*scales.shape, 32)], axis=-1)
    assert np.array_equal(stored, want)


def _reference_attention(q, k_rows, v_rows, starts, window=0):  # type: ignore[no-untyped-def]
    """Attention of each sequence's queries over its (decoded) keys, with ref.attention."""
    outs = []
    for s, (qs, ks, vs) in enumerate(zip(q, k_rows, v_rows, strict=True)):
        outs.append(ref.attention(qs, ks.transpose(1, 0, 2), vs.transpose(1, 0, 2), starts[s], qs.shape[-1] ** -0.5,
                                  window))
    return np.concatenate(outs)


@pytest.mark.parametrize("window", [0, 2])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_paged_attention_decode_and_prefill_with_gqa(ops, dtype: str, window: int) -> None:  # type: ignore[no-untyped-def]
    """Two sequences in one step, their blocks scattered: one decodes a token after 10 cached
    positions, the other prefills 3 tokens; 4 query heads share 2 KV heads; all keys, or a sliding
    window of the last 2."""
    rng = np.random.default_rng(7)
    hq, kvh, hd, block = 4, 2, 32, 4
    lengths, new = [11, 3], [1, 3]
    tables = np.array([[5, 1, 6], [2, 0, 0]], np.int32)
    k_all = [rng.standard_normal((n, kvh, hd)).astype(np.float32) for n in lengths]
    v_all = [rng.standard_normal((n, kvh, hd)).astype(np.float32) for n in lengths]
    k_store, v_store = ops.kv_store(dtype, 8, block, kvh, hd, keys=True), ops.kv_store(dtype, 8, block, kvh, hd, keys=False)
    for s, n in enumerate(lengths):  # every position of each sequence into its blocks
        pos = np.arange(n)
        ops.kv_write(k_store, tables[s, pos // block], pos % block, dev(ops, k_all[s]))
        ops.kv_write(v_store, tables[s, pos // block], pos % block, dev(ops, v_all[s]))
    q = [rng.standard_normal((m, hq, hd)).astype(np.float32) for m in new]
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, new, strict=True)])
    token_seq = np.repeat(np.arange(2, dtype=np.int32), new)
    got = ops.to_numpy(ops.paged_attention(dev(ops, np.concatenate(q)), k_store, v_store, tables, token_seq,
                                           positions, hd ** -0.5, window))
    decoded = [[decode_rows(encode_rows(r, dtype), dtype, hd) for r in rows] for rows in (k_all, v_all)]
    want = _reference_attention(q, decoded[0], decoded[1], [n - m for n, m in zip(lengths, new, strict=True)], window)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_simulated_threads_of_a_block_share_one_shared_array() -> None:
    """On the simulator, threads that ask for a kernel line's shared array at the same moment all get the
    same array (numba's own lookup can hand two of them different ones: the reductions then read garbage).
    Thread switches every microsecond make the race frequent: unserialised, ~10% of these trials split."""
    from ember.kernels.cuda.device import SIMULATOR

    if not SIMULATOR:
        pytest.skip("simulator only: a GPU's shared memory is the hardware's")
    import sys
    import threading

    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    def arrays_given_to_racing_threads() -> int:
        shared, start, got = FakeCUDAShared(0), threading.Barrier(8), []

        def thread() -> None:
            start.wait()
            got.append(id(shared.array(8, np.float32)))

        threads = [threading.Thread(target=thread) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(set(got))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        assert [arrays_given_to_racing_threads() for _ in range(200)] == [1] * 200
    finally:
        sys.setswitchinterval(interval)
    shared = FakeCUDAShared(0)
    a = shared.array(4, np.float32)
    b = shared.array(4, np.int64)  # another line: another array
    assert a is not b and a.dtype == np.float32 and b.dtype == np.int64
