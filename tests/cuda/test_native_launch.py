"""kernels/cuda/native_launch.py's NativeOps against numpy, run two ways:
- on the CPU (always): numpy arrays, each launch run by the host harness (tests/cuda/native_fake_device.py).
  This proves before a GPU sees the code that the grids cover the work, the arguments reach the kernels in
  their C order with their C types, the buffers have the shapes the kernels assume, and a decode step's
  launches are the same at any position (the condition for replaying a captured graph);
- on a GPU (where CuPy finds one): the same tests on the device, and a decode step captured as a CUDA
  graph and replayed at new positions."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ember.kernels.convert import f16_bits_to_f32
from ember.kernels.cuda import native_kernels as nk
from ember.kernels.cuda import repack
from ember.kernels.cuda.native_launch import (Activations, AttentionScratch, NativeKv, NativeOps, NativeWeight,
                                             SamplingBuffers)
from ember.kernels.cuda.native_launch import to_host as host
from ember.kernels.reference.dense import rope
from ember.kernels.sampling import SampleRow, SamplingParams
from ember.kernels.sampling_batch import SamplingBatch, sample_batch
from ember.kernels.tensor_types import TensorType
from tests.cuda.conftest import gpu_ops
from tests.cuda.native_data import random_store, random_weight, reference_attention
from tests.cuda.native_fake_device import HarnessLauncher

pytestmark = pytest.mark.cuda

NEEDS_DEVICE = False  # conftest.py: the host harness stands in for the device where there is none


def _on(ops: NativeOps, store: NativeKv) -> NativeKv:
    """A copy of the store in the ops' memory."""
    xp = ops.xp
    return NativeKv(store.dtype, xp.array(store.data), None if store.scales is None else xp.array(store.scales))


def _weight(ttype: TensorType, rows: int, cols: int, seed: int, xp: Any = np) -> tuple[repack.Repacked, NativeWeight]:
    w = repack.repack(ttype, random_weight(ttype, rows, cols, np.random.default_rng(seed)), rows, cols)
    return w, NativeWeight.upload(w, xp)


@pytest.mark.parametrize("ttype", repack.NATIVE_TYPES, ids=lambda t: t.name)
def test_a_layer_s_matmuls_through_the_launch_layer(ops: NativeOps, ttype: TensorType) -> None:
    rng = np.random.default_rng(int(ttype))
    batch, hidden, ffn = 6, 512, 768
    norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    xp = ops.xp
    (gate_w, gate), (up_w, up), (down_w, down) = (_weight(ttype, r, c, s, xp) for r, c, s in
                                                  ((ffn, hidden, 1), (ffn, hidden, 2), (hidden, ffn, 3)))
    x = rng.standard_normal((batch, hidden)).astype(np.float32)
    acts, acts_ffn = Activations.allocate(xp, 8, hidden), Activations.allocate(xp, 8, ffn)
    floats = ttype in (TensorType.F16, TensorType.BF16)
    ops.quantize(xp.asarray(x), acts, norm_weight=xp.asarray(norm), floats=floats)
    h_dev = xp.zeros((batch, ffn), xp.float32)
    ops.gemv(gate, acts, h_dev, batch, "swiglu", w2=up)
    ops.quantize(h_dev, acts_ffn, floats=floats)
    residual_dev = xp.array(x)
    ops.gemv(down, acts_ffn, residual_dev, batch, "add")
    h, residual = host(h_dev), host(residual_dev)

    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-6) * norm
    g, u = (normed @ repack.dequantize(w).astype(np.float64).T for w in (gate_w, up_w))
    with np.errstate(over="ignore"):  # a very negative gate: silu's 0, as the kernel's expf gives
        expected_h = g / (1 + np.exp(-g)) * u
    expected = x64 + expected_h @ repack.dequantize(down_w).astype(np.float64).T
    # q8_1 activations cost ~0.5% of a vector's norm at each of the two matmuls; floats cost nothing
    tolerance = 1e-5 if floats else 0.02
    assert np.linalg.norm(h - expected_h) <= tolerance * np.linalg.norm(expected_h)
    assert np.linalg.norm(residual - expected) <= tolerance * np.linalg.norm(expected - x64) + 1e-6


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_rope_kv_write_then_attention_through_the_launch_layer(ops: NativeOps, kv_dtype: str) -> None:
    rng = np.random.default_rng(3)
    batch, q_heads, kv_heads, head_dim, block_size, width = 3, 8, 2, 128, 16, 8
    xp = ops.xp
    k_cache, v_cache = (random_store(kv_dtype, 32, block_size, kv_heads, head_dim, rng) for _ in range(2))
    tables = rng.permutation(32)[:batch * width].reshape(batch, width).astype(np.int32)
    positions = np.array([40, 0, 100], np.int32)  # each row's new token, written at its position
    slots = np.array([tables[b, p // block_size] * block_size + p % block_size for b, p in enumerate(positions)])
    q = rng.standard_normal((batch, q_heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    inv_freq = (1e4 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
    q_dev, k_dev, v_dev = (xp.array(a) for a in (q, k, v))
    k_cache_dev, v_cache_dev = _on(ops, k_cache), _on(ops, v_cache)
    ops.qk_rope_kv(q_dev, k_dev, v_dev, k_cache_dev, v_cache_dev, xp.asarray(positions), xp.asarray(slots, xp.int64),
                   xp.asarray(inv_freq), False)
    rotated = host(q_dev)
    np.testing.assert_allclose(rotated, rope(q, positions, inv_freq, False), rtol=1e-5, atol=2e-6)

    lengths = (positions + 1).astype(np.int32)
    out = xp.zeros(q.shape, xp.float32)
    ops.attention(q_dev, k_cache_dev, v_cache_dev, xp.asarray(tables), xp.asarray(lengths), head_dim ** -0.5,
                  AttentionScratch.allocate(xp, batch, q_heads, head_dim), out)
    written = NativeKv(kv_dtype, host(k_cache_dev.data), None if k_cache.scales is None else host(k_cache_dev.scales))
    values = NativeKv(kv_dtype, host(v_cache_dev.data), None if v_cache.scales is None else host(v_cache_dev.scales))
    np.testing.assert_allclose(host(out), reference_attention(rotated, written, values, tables, lengths,
                                                              head_dim ** -0.5), rtol=1e-5, atol=2e-6)


def test_a_decode_step_launches_the_same_kernels_over_the_same_buffers_at_any_position(  # type: ignore[no-untyped-def]
        lib) -> None:
    launcher = HarnessLauncher(lib)
    ops = NativeOps(np, launcher)
    rng = np.random.default_rng(4)
    batch, q_heads, kv_heads, head_dim = 2, 4, 2, 64
    _, wq = _weight(TensorType.Q8_0, q_heads * head_dim, 256, 5)
    k_cache, v_cache = (NativeKv.allocate(np, "q8_0", 16, 16, kv_heads, head_dim) for _ in range(2))
    # the step's static buffers: filled in place between steps, never reallocated
    x, acts = np.zeros((batch, 256), np.float32), Activations.allocate(np, batch, 256)
    q, out = np.zeros((batch, q_heads * head_dim), np.float32), np.zeros((batch, q_heads, head_dim), np.float32)
    k, v = np.zeros((batch, kv_heads, head_dim), np.float32), np.zeros((batch, kv_heads, head_dim), np.float32)
    positions, slots, lengths = np.zeros(batch, np.int32), np.zeros(batch, np.int64), np.zeros(batch, np.int32)
    tables, scratch = np.arange(batch * 8, dtype=np.int32).reshape(batch, 8), AttentionScratch.allocate(
        np, batch, q_heads, head_dim)
    inv_freq = np.ones(head_dim // 2, np.float32)
    traces = []
    for step in range(3):
        x[...] = rng.standard_normal(x.shape)
        positions[...] = [5 + step, 30 + step]
        slots[...] = [tables[b, p // 16] * 16 + p % 16 for b, p in enumerate(positions)]
        lengths[...] = positions + 1
        del launcher.launches[:]
        ops.quantize(x, acts)
        ops.gemv(wq, acts, q, batch)
        heads = q.reshape(batch, q_heads, head_dim)
        ops.qk_rope_kv(heads, k, v, k_cache, v_cache, positions, slots, inv_freq, True)
        ops.attention(heads, k_cache, v_cache, tables, lengths, 0.125, scratch, out)
        traces.append(list(launcher.launches))
    assert traces[0] == traces[1] == traces[2]  # kernels, grids, blocks, pointers and scalars alike
    assert [t.kernel for t in traces[0]] == ["ember_quantize_q8_1", "ember_gemv_q8_0_b2_store",
                                             "ember_qk_rope_kv_q8_0_d64", "ember_attention_q8_0_d64_h2",
                                             "ember_attention_combine"]


@pytest.mark.parametrize("ttype", [TensorType.Q4_K, TensorType.Q6_K, TensorType.Q8_0], ids=lambda t: t.name)
def test_prefill_goes_through_f16_tiles_and_a_gemm(ops: NativeOps, ttype: TensorType) -> None:
    xp = ops.xp
    w, dw = _weight(ttype, 300, 512, 6, xp)
    x = np.random.default_rng(6).standard_normal((20, 512)).astype(np.float32)
    y = host(ops.prefill_matmul(xp.asarray(x), dw, tile_rows=128))  # three tiles, the last one short
    tile = xp.zeros((300, 512), xp.uint16)
    ops.dequantize_f16(dw, 0, tile)
    exact = repack.dequantize(w)
    assert np.array_equal(f16_bits_to_f32(host(tile)), exact.astype(np.float16).astype(np.float32))
    expected = x.astype(np.float64) @ exact.astype(np.float64).T
    assert np.linalg.norm(y - expected) <= 2e-3 * np.linalg.norm(expected)


def test_more_than_8_rows_go_8_at_a_time(lib) -> None:  # type: ignore[no-untyped-def]
    launcher = HarnessLauncher(lib)
    ops = NativeOps(np, launcher)
    w_host, w = _weight(TensorType.Q4_K, 24, 256, 8)
    x = np.random.default_rng(8).standard_normal((19, 256)).astype(np.float32)
    acts, y = Activations.allocate(np, 19, 256), np.zeros((19, 24), np.float32)
    ops.quantize(x, acts)
    del launcher.launches[:]
    ops.gemv(w, acts, y, 19)
    assert [t.kernel for t in launcher.launches] == ["ember_gemv_q4_k_b8_store"] * 2 + ["ember_gemv_q4_k_b3_store"]
    exact = x.astype(np.float64) @ repack.dequantize(w_host).astype(np.float64).T
    assert np.linalg.norm(y - exact) <= 0.02 * np.linalg.norm(exact)


def test_bad_launches_are_refused_before_the_device(lib) -> None:  # type: ignore[no-untyped-def]
    ops = NativeOps(np, HarnessLauncher(lib))
    _, w = _weight(TensorType.Q8_0, 8, 256, 7)
    acts = Activations.allocate(np, 9, 256)
    with pytest.raises(ValueError, match="output"):
        ops.gemv(w, acts, np.zeros((2, 9), np.float32), 2)
    with pytest.raises(ValueError, match="swiglu"):
        ops.gemv(w, acts, np.zeros((2, 8), np.float32), 2, "swiglu")
    with pytest.raises(TypeError, match="missing"):
        ops.launch(nk.norm_quantize(False), (1,), (256,), x=np.zeros((1, 32), np.float32))
    misaligned = np.zeros(40, np.float32)[1:33].reshape(1, 32)
    with pytest.raises(ValueError, match="aligned"):
        ops.quantize(misaligned, Activations.allocate(np, 1, 32))
    with pytest.raises(ValueError, match="KV dtype"):
        NativeKv.allocate(np, "q4", 1, 1, 1, 64)


def test_a_captured_decode_step_replays_at_new_positions() -> None:
    """On a GPU: a decode step (quantize, q projection, rope + KV write, attention) captured once as a
    CUDA graph, then replayed after the step's buffers are refilled in place, gives what the eager step
    gives at those positions, caches included (the proof that no scalar froze into the graph)."""
    ops = gpu_ops()
    import cupy  # noqa: PLC0415

    rng = np.random.default_rng(8)
    batch, q_heads, kv_heads, head_dim = 2, 8, 2, 128
    _, wq = _weight(TensorType.Q4_K, q_heads * head_dim, 512, 9, cupy)
    k_cache, v_cache = (_on(ops, random_store("q8_0", 16, 16, kv_heads, head_dim, rng)) for _ in range(2))
    x, acts = cupy.zeros((batch, 512), cupy.float32), Activations.allocate(cupy, batch, 512)
    q = cupy.zeros((batch, q_heads, head_dim), cupy.float32)
    k, v = cupy.zeros((batch, kv_heads, head_dim), cupy.float32), cupy.zeros((batch, kv_heads, head_dim), cupy.float32)
    out = cupy.zeros((batch, q_heads, head_dim), cupy.float32)
    positions, lengths = cupy.zeros(batch, cupy.int32), cupy.zeros(batch, cupy.int32)
    slots = cupy.zeros(batch, cupy.int64)
    tables = cupy.asarray(np.arange(batch * 8, dtype=np.int32).reshape(batch, 8))
    scratch = AttentionScratch.allocate(cupy, batch, q_heads, head_dim)
    inv_freq = cupy.asarray((1e6 ** (-np.arange(0, head_dim, 2) / head_dim)).astype(np.float32))

    def fill(step: int) -> None:
        x[...] = cupy.asarray(rng.standard_normal((batch, 512)).astype(np.float32))
        k[...], v[...] = (cupy.asarray(rng.standard_normal(k.shape).astype(np.float32)) for _ in range(2))
        pos = np.array([7 + 40 * step, 60 + 3 * step])
        positions[...] = cupy.asarray(pos.astype(np.int32))
        table = host(tables)
        slots[...] = cupy.asarray(np.array([table[b, p // 16] * 16 + p % 16 for b, p in enumerate(pos)]))
        lengths[...] = cupy.asarray((pos + 1).astype(np.int32))
        cupy.cuda.Device().synchronize()

    def step() -> None:
        ops.quantize(x, acts)
        ops.gemv(wq, acts, q.reshape(batch, q_heads * head_dim), batch)
        ops.qk_rope_kv(q, k, v, k_cache, v_cache, positions, slots, inv_freq, False)
        ops.attention(q, k_cache, v_cache, tables, lengths, head_dim ** -0.5, scratch, out)

    fill(0)
    step()  # eager first: every kernel compiled and loaded before the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    for n in (1, 2):
        fill(n)
        caches = [a.copy() for a in (k_cache.data, k_cache.scales, v_cache.data, v_cache.scales)]
        graph.launch(stream)
        stream.synchronize()
        replayed = [host(out)] + [host(a) for a in (k_cache.data, k_cache.scales, v_cache.data, v_cache.scales)]
        for a, saved in zip((k_cache.data, k_cache.scales, v_cache.data, v_cache.scales), caches):
            a[...] = saved
        step()
        cupy.cuda.Device().synchronize()
        eager = [host(out)] + [host(a) for a in (k_cache.data, k_cache.scales, v_cache.data, v_cache.scales)]
        for got, expected in zip(replayed, eager):
            assert np.array_equal(got, expected)


def test_the_native_sampler_matches_the_host_sampler(ops: NativeOps) -> None:
    """Grammar masks, logit bias, the three penalties, greedy and seeded draws with top-k/p and min-p:
    the tokens of kernels/sampling.py's host sampler, and its logprobs."""
    xp = ops.xp
    rng = np.random.default_rng(9)
    vocab = 3000
    logits = rng.standard_normal((7, vocab)).astype(np.float32) * np.float32(2)
    grammar = np.zeros(-(-vocab // 32), np.uint32)
    grammar[[0, 5, 93]] = [0b1011, 1 << 7, 0xFFFF]  # tokens 0, 1, 3, 167 and 2976-2991
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                             logit_bias={7: 5.0, 8: -100.0}),
              SamplingParams(temperature=1.2, top_p=0.7), SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.7)]
    history = [list(rng.integers(0, vocab, 30)) for _ in params]

    def rows(seed: int) -> list[SampleRow]:
        return [SampleRow(k, p, np.random.default_rng(seed + k), prompt=history[k][:10], generated=history[k][10:],
                          allowed=grammar if k == 6 else None) for k, p in enumerate(params)]

    buffers = SamplingBuffers.allocate(xp, 8, vocab, entries=256)
    seen = set()
    for seed in range(5):
        expected = sample_batch(logits, SamplingBatch.of(rows(seed)))
        sampled = SamplingBatch.of(rows(seed))
        buffers.fill(xp, sampled)
        ops.sample(xp.array(logits), buffers)
        got = buffers.choices(sampled)
        assert [c.token for c in got] == [c.token for c in expected]
        np.testing.assert_allclose([c.logprob for c in got], [c.logprob for c in expected], rtol=1e-5, atol=1e-5)
        seen.add(tuple(c.token for c in got))
    assert len(seen) > 1  # the seeds draw differently
    with pytest.raises(ValueError, match="top alternatives"):
        buffers.fill(xp, SamplingBatch.of([SampleRow(0, SamplingParams(logprobs=2), np.random.default_rng(0))]))
