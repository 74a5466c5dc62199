"""The native CUDA C++ kernels (kernels/cuda/native), checked without a GPU:
- every kernel of the catalog compiles with nvcc for sm_80, sm_89 and sm_90 with no spills and no stack
  (local memory), and with NVRTC (the very source CuPy compiles) without a warning;
- the GEMVs' SASS holds IDP.4A (quantized types) and 128-bit global loads, and no kernel touches local memory;
- the host harness runs the kernels' per-thread arithmetic lane by lane and matches numpy: weight units
  bit for bit with gguf, the q8_1 activations bit for bit with ggml's rule, the GEMVs, attention and the
  rope/KV-write kernel within float32 rounding.
Each tool that is missing (nvcc) or cannot be fetched (cuobjdump, NVRTC) skips its tests."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from ember.kernels.convert import (f16_bits_to_f32, f32_to_bf16_bits, f32_to_f16_bits, quantize_q8_0_split,
                                   quantize_q8_1_split)
from ember.kernels.cuda import native_kernels as nk
from ember.kernels.cuda import repack
from ember.kernels.cuda.native_launch import NativeKv
from ember.kernels.reference.dense import rope
from ember.kernels.sampling import SamplingParams
from ember.kernels.sampling_batch import sample
from ember.kernels.tensor_types import TensorType
from tests.cuda import native_toolchain as tools
from tests.cuda.native_data import decode_kv, random_store, random_weight, reference_attention
from tests.cuda.native_harness import Harness, aligned

pytestmark = pytest.mark.cuda

NEEDS_DEVICE = False  # conftest.py: compilers and the host, no device
ARCHS = ("80", "89", "90")


# --- compiled for the devices ---------------------------------------------------------------------
@pytest.fixture(scope="module", params=ARCHS, ids=lambda a: f"sm_{a}")
def cubin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The whole catalog compiled for one architecture, and ptxas's report."""
    out = tmp_path_factory.mktemp("native") / f"catalog_sm{request.param}.cubin"
    return out, tools.compile_cubin(nk.translation_unit(nk.catalog()), request.param, out)


def test_every_kernel_compiles_without_spills(cubin: tuple[Path, str]) -> None:
    report = tools.ptxas_report(cubin[1])
    assert set(report) == {k.name for k in nk.catalog()}
    assert not {name: s for name, s in report.items() if s.spill_stores or s.spill_loads}
    assert max(s.registers for s in report.values()) <= 255


def test_sass_gemvs_use_dp4a_and_128_bit_loads_and_nothing_uses_local_memory(cubin: tuple[Path, str]) -> None:
    # ptxas's "stack frame" also counts a call's frame (a shuffle's fallback where the compiler cannot
    # prove a warp converged): local memory is what the SASS loads and stores there
    functions = tools.sass_functions(cubin[0])
    assert set(functions) == {k.name for k in nk.catalog()}
    for name, sass in functions.items():
        assert "LDL" not in sass and "STL" not in sass, name
        if name.startswith("ember_gemv_"):
            assert "LDG.E.128" in sass, name
            quantized = not name.startswith(("ember_gemv_f16", "ember_gemv_bf16"))
            assert ("IDP.4A" in sass) == quantized, name


def test_every_kernel_compiles_with_nvrtc_as_cupy_will() -> None:
    failures = {}
    for kernel in nk.catalog():
        code, log = tools.nvrtc_compile(kernel, "sm_90")
        if code != 0 or log.strip():
            failures[kernel.name] = log[:800]
    assert not failures


# --- the per-thread arithmetic on the host --------------------------------------------------------
@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(tools.build_harness())


def test_device_helpers_match_numpy(harness: Harness) -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(-2**31, 2**31, 4096, dtype=np.int64).astype(np.int32)
    b = rng.integers(-2**31, 2**31, 4096, dtype=np.int64).astype(np.int32)
    dots, diffs = harness.dp4a_vsub4(a, b)
    av, bv = a.view(np.int8).reshape(-1, 4).astype(np.int64), b.view(np.int8).reshape(-1, 4).astype(np.int64)
    assert np.array_equal(dots, (av * bv).sum(axis=1))
    assert np.array_equal(diffs.view(np.uint8), (a.view(np.uint8).astype(np.int32) - b.view(np.uint8)) % 256)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 4000),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 6e-8, 2.9e-8, 3e-8, 1e-40],
                                 np.float32)])
    f16, bf16, back = harness.halves(x)
    assert np.array_equal(f16, f32_to_f16_bits(x))
    assert np.array_equal(bf16, f32_to_bf16_bits(x))
    assert np.array_equal(back.view(np.uint32), f16_bits_to_f32(f16).view(np.uint32))


@pytest.mark.parametrize("ttype", repack.NATIVE_TYPES, ids=lambda t: t.name)
def test_weight_units_decode_as_gguf_bit_for_bit(harness: Harness, ttype: TensorType) -> None:
    data = random_weight(ttype, 3, 1024, np.random.default_rng(int(ttype)))
    ours = harness.unit_values(repack.repack(ttype, data, 3, 1024))
    theirs = gguf_dequantize(np.ascontiguousarray(data).view(np.uint8), gguf.GGMLQuantizationType(int(ttype)))
    assert np.array_equal(ours.view(np.uint32), theirs.reshape(3, 1024).astype(np.float32).view(np.uint32))


def test_q8_1_activations_follow_ggml_bit_for_bit(harness: Harness) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(np.float32) * np.float32(3)
    x[1, :32] = 0.0  # an all-zero block: scale 0, quants 0
    x[2, 32:64] *= np.float32(1e-30)
    xf, xq, xd = harness.quantize(x)
    d, q = quantize_q8_1_split(x)
    assert np.array_equal(xf, x)
    assert np.array_equal(xq, q)
    assert np.array_equal(xd[..., 0].view(np.uint32), d.view(np.uint32))
    sums = q.reshape(3, -1, 32).astype(np.int64).sum(axis=2).astype(np.float32)
    assert np.array_equal(xd[..., 1], d * sums)


def test_rmsnorm_before_quantizing(harness: Harness) -> None:
    rng = np.random.default_rng(2)
    x, weight = rng.standard_normal((2, 1024)).astype(np.float32), rng.uniform(0.5, 1.5, 1024).astype(np.float32)
    xf, xq, xd = harness.quantize(x, weight, eps=1e-6)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-6) * weight
    np.testing.assert_allclose(xf, expected, rtol=2e-6, atol=1e-6)
    d, q = quantize_q8_1_split(xf)  # the quants are exactly those of the normed floats
    assert np.array_equal(xq, q) and np.array_equal(xd[..., 0], d)


def _reference_gemv(w: repack.Repacked, x: np.ndarray, harness: Harness) -> tuple[np.ndarray, np.ndarray]:
    """(W x in float64 from the activations the kernel sees, the bound |W| |x| that scales float32 error)."""
    weights = repack.dequantize(w).astype(np.float64)
    if w.ttype in (TensorType.F16, TensorType.BF16):
        seen = x.astype(np.float64)
    else:
        _, xq, xd = harness.quantize(x)
        seen = (xq.reshape(x.shape[0], -1, 32) * xd[..., :1].astype(np.float64)).reshape(x.shape)
    return seen @ weights.T, np.abs(seen) @ np.abs(weights).T


@pytest.mark.parametrize("ttype", repack.NATIVE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_gemv_matches_numpy(harness: Harness, ttype: TensorType, batch: int) -> None:
    rng = np.random.default_rng(batch * 10 + int(ttype))
    rows, cols = 37, 1280  # rows not a multiple of the block's 4 warps; 40 units: lanes wrap once, unevenly
    w = repack.repack(ttype, random_weight(ttype, rows, cols, rng), rows, cols)
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    y = harness.gemv(w, x)
    expected, bound = _reference_gemv(w, x, harness)
    assert np.all(np.abs(y - expected) <= 1e-5 * bound + 1e-30)
    if ttype not in (TensorType.F16, TensorType.BF16):  # q8_1 costs the activations ~0.5% of their norm
        exact = x.astype(np.float64) @ repack.dequantize(w).astype(np.float64).T
        assert np.linalg.norm(y - exact) <= 0.02 * np.linalg.norm(exact)


@pytest.mark.parametrize("ttype", [TensorType.Q4_K, TensorType.Q6_K, TensorType.BF16], ids=lambda t: t.name)
def test_gemv_epilogues_add_into_the_residual_and_fuse_swiglu(harness: Harness, ttype: TensorType) -> None:
    rng = np.random.default_rng(7)
    rows, cols, batch = 12, 512, 5
    gate = repack.repack(ttype, random_weight(ttype, rows, cols, rng), rows, cols)
    up = repack.repack(ttype, random_weight(ttype, rows, cols, rng), rows, cols)
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    x *= np.float32(8 / np.abs(harness.gemv(gate, x)).max())  # gate values on silu's curve, not its tails
    residual = rng.standard_normal((batch, rows)).astype(np.float32)
    g, u = harness.gemv(gate, x), harness.gemv(up, x)
    assert np.array_equal(harness.gemv(gate, x, "add", y=residual), residual + g)
    fused = harness.gemv(gate, x, "swiglu", w2=up)
    np.testing.assert_allclose(fused, g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 8, 8), (128, 8, 2), (128, 12, 2), (256, 6, 1),
                                                      (512, 4, 2)])
def test_split_k_attention_matches_numpy(harness: Harness, kv_dtype: str, head_dim: int, q_heads: int,
                                         kv_heads: int) -> None:
    rng = np.random.default_rng(head_dim + q_heads)
    block_size, width = 16, 12
    k = random_store(kv_dtype, 64, block_size, kv_heads, head_dim, rng)
    v = random_store(kv_dtype, 64, block_size, kv_heads, head_dim, rng)
    lengths = np.array([1, 37, 190, 0, 16])  # one key, uneven, 12 blocks, a padded row, exactly one block
    tables = rng.permutation(64)[:5 * width].reshape(5, width).astype(np.int32)
    q = rng.standard_normal((5, q_heads, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    sentinel = np.full(q.shape, 7.0, np.float32)
    hpb = nk.heads_per_block(head_dim, q_heads // kv_heads)
    out = harness.attention(q, k, v, tables, lengths, scale, splits=8, heads_per_block=hpb, out=sentinel.copy())
    expected = reference_attention(q, k, v, tables, lengths, scale)
    live = lengths > 0
    np.testing.assert_allclose(out[live], expected[live], rtol=1e-5, atol=2e-6)
    assert np.array_equal(out[~live], sentinel[~live])  # padding exits at once, leaving its output as it was


def test_attention_is_the_same_for_any_split_count_and_heads_per_block(harness: Harness) -> None:
    rng = np.random.default_rng(5)
    k, v = (random_store("f16", 20, 32, 2, 128, rng) for _ in range(2))
    q = rng.standard_normal((2, 8, 128)).astype(np.float32)
    tables, lengths = rng.permutation(20)[:20].reshape(2, 10).astype(np.int32), np.array([300, 77])
    outs = [harness.attention(q, k, v, tables, lengths, 0.1, splits, hpb) for splits in (1, 5, 32) for hpb in (1, 4)]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=2e-6, atol=1e-7)


def _cache_values(store: NativeKv, slots: np.ndarray) -> np.ndarray:
    flat = store.data.reshape((-1,) + store.data.shape[2:])
    scales = None if store.scales is None else store.scales.reshape((-1,) + store.scales.shape[2:])[slots]
    return decode_kv(store.dtype, flat[slots], scales)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8_0"])
def test_kv_write_converts_bit_for_bit(harness: Harness, kv_dtype: str) -> None:
    rng = np.random.default_rng(11)
    q_heads, kv_heads, head_dim = 4, 2, 128
    k_cache, v_cache = (NativeKv.allocate(np, kv_dtype, 4, 8, kv_heads, head_dim) for _ in range(2))
    q = rng.standard_normal((3, q_heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((3, kv_heads, head_dim)).astype(np.float32) * np.float32(5) for _ in range(2))
    slots = np.array([5, -1, 30])  # the middle row is padding: nothing of it is written
    out = harness.qk_rope_kv(q, k, v, k_cache, v_cache, np.array([3, 4, 5]), slots, np.zeros(0, np.float32), False)
    assert np.array_equal(out, q)  # no rotary dimensions, no norm: q passes through
    for store, rows in ((k_cache, k), (v_cache, v)):
        flat = store.data.reshape((-1, kv_heads, head_dim))
        live = rows[[0, 2]]
        if kv_dtype == "q8_0":
            scales, quants = quantize_q8_0_split(live)
            assert np.array_equal(flat[[5, 30]], quants)
            assert np.array_equal(store.scales.reshape((-1, kv_heads, head_dim // 32))[[5, 30]], scales)
        else:
            encode = {"f32": lambda a: a, "f16": f32_to_f16_bits, "bf16": f32_to_bf16_bits}[kv_dtype]
            assert np.array_equal(flat[[5, 30]], encode(live))
        untouched = np.ones(len(flat), bool)
        untouched[[5, 30]] = False
        assert not flat[untouched].any()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rotary", [(128, 128), (64, 16), (256, 256)])
def test_qk_norm_rope_and_kv_write_match_numpy(harness: Harness, interleaved: bool, head_dim: int,
                                               rotary: int) -> None:
    rng = np.random.default_rng(head_dim + rotary + interleaved)
    q_heads, kv_heads, batch = 6, 2, 3
    inv_freq = (1e6 ** (-np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    q = rng.standard_normal((batch, q_heads, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((batch, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    q_norm, k_norm = (rng.uniform(0.5, 1.5, head_dim).astype(np.float32) for _ in range(2))
    positions, slots = np.array([0, 17, 131071]), np.array([2, 9, 14])
    k_cache, v_cache = (NativeKv.allocate(np, "f32", 2, 8, kv_heads, head_dim) for _ in range(2))
    out = harness.qk_rope_kv(q, k, v, k_cache, v_cache, positions, slots, inv_freq, interleaved, q_norm, k_norm)

    def normed(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        x64 = x.astype(np.float64)
        return (x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-6) * weight).astype(np.float32)

    np.testing.assert_allclose(out, rope(normed(q, q_norm), positions, inv_freq, interleaved), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(_cache_values(k_cache, slots), rope(normed(k, k_norm), positions, inv_freq, interleaved),
                               rtol=1e-5, atol=2e-6)
    assert np.array_equal(_cache_values(v_cache, slots), v)


def test_aligned_copies_keep_their_values() -> None:  # the harness's inputs: a copy at a 64-byte boundary
    a = np.arange(10, dtype=np.float32)[1:]
    b = aligned(a)
    assert b.ctypes.data % 64 == 0 and np.array_equal(a, b)


def _sampling_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, SamplingParams]]:
    cases = []
    for vocab in (1000, 5003):
        for temperature, top_k, top_p, min_p in [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0),
                                                 (1.0, 0, 0.9, 0.0), (1.3, 50, 0.8, 0.05), (0.8, 20, 0.95, 0.05),
                                                 (1.0, 1, 1.0, 0.0), (2.0, 3000, 0.5, 0.0), (0.001, 0, 0.9, 0.0),
                                                 (1.0, 0, 1.0, 0.2)]:
            for ties in (False, True):
                logits = rng.standard_normal(vocab).astype(np.float32) * np.float32(3)
                if ties:  # few distinct values: top-k and top-p cut inside runs of equal logits
                    logits = np.round(logits * 2) / np.float32(2)
                cases.append((logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)))
    # top-k and top-p both cut inside one run of ties: top-k keeps 2 of the five 3.0s, top-p would keep 4;
    # the shorter prefix wins
    run = np.full(100, -5.0, np.float32)
    run[0], run[1:6] = 5.0, 3.0
    cases += [(run, SamplingParams(temperature=1.0, top_k=3, top_p=0.9))] * 8
    tied_best = np.round(rng.standard_normal(3000).astype(np.float32))
    tied_best[[10, 20, 2999]] = tied_best.max()
    cases.append((tied_best, SamplingParams(temperature=1.0, min_p=1.0)))  # only the tied best tokens remain
    grammar = np.full(2000, -np.inf, np.float32)  # a grammar's few allowed tokens
    grammar[[3, 70, 71, 1999]] = [0.5, 2.0, 2.0, -1.0]
    cases.append((grammar, SamplingParams(temperature=1.0, top_p=0.9)))
    cases.append((grammar, SamplingParams(temperature=0.9, top_k=2)))
    return cases


def test_the_device_sampler_draws_the_host_sampler_s_tokens(harness: Harness) -> None:
    rng = np.random.default_rng(12)
    drawn = {}
    for seed in range(6):
        for case, (logits, params) in enumerate(_sampling_cases(rng)):
            host = sample(logits, params, np.random.default_rng(seed), logprob=True)
            u = 0.0 if params.greedy else np.random.default_rng(seed).random()  # the one number choice draws
            token, best, log_total = harness.sample(logits[None], np.array([params.temperature]),
                                                    np.array([params.top_k]), np.array([params.top_p]),
                                                    np.array([params.min_p]), np.array([u]))
            assert token[0] == host.token, (seed, case, params)
            np.testing.assert_allclose(logits[token[0]] - best[0] - log_total[0], host.logprob, rtol=1e-6, atol=1e-6)
            drawn.setdefault(case, set()).add(int(token[0]))
    assert sum(len(tokens) > 1 for tokens in drawn.values()) > 10  # the seeds draw different tokens: a real draw
