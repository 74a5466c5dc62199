"""kernels/cpu/quant_matmul.py against the numpy reference: matmul, embedding, and pack's zero-copy.

The reference product is quant_reference.dequantize(...) @ x in float64, where x is the activation the
kernel is defined to multiply: for the decode rows of a quantized weight that is x_hat, x after the
round trip of kernels/convert.py's q8_0 (Q8_0 weights) or q8_K (K-quants) (llama.cpp's numerics; the
integer kernels are in kernels/cpu/int8_dots.py), for every other row x itself. The kernels accumulate in
float32 (lane partial sums, trees, FMAs), so each output may differ by float32 rounding of its terms:
a few eps32 times sum_i |w_i x_i| for the row. The tolerance below is 2e-5 times that sum (about 170
eps32, a loose bound for sums of <= 1024 terms); a wrong scale, nibble or bit shows up as O(1).
"""
from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ember.kernels.cpu import quant_matmul as qm
from ember.kernels.cpu import twin
from ember.kernels.convert import dequantize_q8_0, quantize_q8_0, quantize_q8_k_split
from ember.kernels.cpu.quant_matmul import CpuWeight, embedding, matmul, pack
from ember.kernels.reference.quant import dequantize, quantize
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import TensorType, row_bytes

ALL_TYPES = [TensorType.F32, TensorType.F16, TensorType.BF16, *sorted(qm.INT8_TYPES)]
Q8_0_ACTIVATIONS = {TensorType.Q8_0, TensorType.Q4_0, TensorType.Q4_1, TensorType.Q5_0, TensorType.Q5_1,
                    TensorType.IQ4_NL}
TOKENS = (1, 2, 3, 5, 8, 17, 33)
REL_TOL = 2e-5


def make_weight(ttype: TensorType, rows: int, cols: int, seed: int = 0) -> tuple[CpuWeight, np.ndarray]:
    """A packed random weight and its exact dequantized values (float64)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data = quantize(ttype, w)
    packed = pack(RawTensor("w", ttype, (rows, cols), data))
    return packed, dequantize(ttype, data, cols).astype(np.float64)


def multiplied(x: np.ndarray, ttype: TensorType, decode_rows: np.ndarray | None) -> np.ndarray:
    """The activation matmul multiplies by a weight of type ttype, as float64."""
    x64 = x.astype(np.float64)
    if ttype in qm.INT8_TYPES and decode_rows is not None:
        x64[decode_rows] = x_hat(x, ttype)[decode_rows]
    return x64


def x_hat(x: np.ndarray, ttype: TensorType) -> np.ndarray:
    """x after the round trip the integer kernels put it through: q8_0 against weights of 32-value
    blocks, one scale per 256 values (q8_K) against K-quants."""
    if ttype in Q8_0_ACTIVATIONS:
        return dequantize_q8_0(quantize_q8_0(x), x.shape[-1]).astype(np.float64)
    scales, quants = quantize_q8_k_split(x)
    return (quants.reshape(*x.shape[:-1], -1, 256) * scales[..., None].astype(np.float64)).reshape(x.shape)


def assert_product_close(y: np.ndarray, x: np.ndarray, w64: np.ndarray, ttype: TensorType,
                         decode_rows: np.ndarray | None = None) -> None:
    x64 = multiplied(x, ttype, decode_rows)
    expected = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T  # sum_i |w_i x_i| per output
    assert y.shape == expected.shape and y.dtype == np.float32
    excess = np.abs(y - expected) - REL_TOL * scale
    assert excess.max() <= 0, f"worst excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"


@pytest.mark.parametrize("ttype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
@pytest.mark.parametrize("superblocks", [1, 2, 3, 4])
def test_matmul_matches_reference(ttype: TensorType, rows: int, superblocks: int) -> None:
    cols = 256 * superblocks
    weight, w64 = make_weight(ttype, rows, cols, seed=rows + superblocks)
    rng = np.random.default_rng(superblocks)
    for n in TOKENS:
        x = rng.standard_normal((n, cols)).astype(np.float32)
        assert_product_close(matmul(x, weight), x, w64, ttype)  # prompt rows
        every, some = np.ones(n, bool), rng.random(n) < 0.5
        assert_product_close(matmul(x, weight, every), x, w64, ttype, every)  # decode rows
        assert_product_close(matmul(x, weight, some), x, w64, ttype, some)  # a step mixing both


# Q8_0 blocks per row: 1, 3, 8+1, 4+1, 4+3, 8+4 (the demo model's hidden 384), 8+4+2
@pytest.mark.parametrize("ttype,cols", [(TensorType.Q8_0, 32), (TensorType.Q8_0, 96), (TensorType.Q8_0, 288),
                                        (TensorType.Q8_0, 160), (TensorType.Q8_0, 224), (TensorType.Q8_0, 384),
                                        (TensorType.Q8_0, 448), (TensorType.Q4_0, 96), (TensorType.Q4_1, 160),
                                        (TensorType.Q5_0, 224), (TensorType.Q5_1, 448), (TensorType.IQ4_NL, 288),
                                        (TensorType.F16, 40), (TensorType.BF16, 200), (TensorType.F16, 1000)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_matmul_rows_that_are_not_whole_super_blocks(ttype: TensorType, cols: int) -> None:
    """Rows of any number of 32-value blocks and 16-bit rows of any length take the tail paths."""
    weight, w64 = make_weight(ttype, 5, cols)
    for n in (1, 6):
        x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
        assert_product_close(matmul(x, weight), x, w64, ttype)
        assert_product_close(matmul(x, weight, np.ones(n, bool)), x, w64, ttype, np.ones(n, bool))


def test_matmul_accepts_a_vector() -> None:
    weight, w64 = make_weight(TensorType.Q4_K, 9, 512)
    x = np.random.default_rng(1).standard_normal(512).astype(np.float32)
    for decode in (False, True):
        y = matmul(x, weight, decode)
        assert y.shape == (9,)
        assert_product_close(y[None, :], x[None, :], w64, TensorType.Q4_K, np.array([decode]))


def test_matmul_rejects_wrong_width() -> None:
    weight, _ = make_weight(TensorType.Q8_0, 4, 256)
    with pytest.raises(ValueError):
        matmul(np.zeros((1, 512), np.float32), weight)


@pytest.mark.parametrize("ttype", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_equals_dequantize(ttype: TensorType) -> None:
    """Row dequantization follows the reference's operation order (no FMA), so it is exact."""
    weight, w64 = make_weight(ttype, 40, 768)
    ids = np.array([0, 39, 7, 7, 13])
    np.testing.assert_array_equal(embedding(weight, ids), w64[ids].astype(np.float32))
    assert embedding(weight, np.array([], np.int64)).shape == (0, 768)


def test_embedding_rejects_bad_ids() -> None:
    weight, _ = make_weight(TensorType.Q6_K, 4, 256)
    with pytest.raises(IndexError):
        embedding(weight, np.array([4]))


@pytest.mark.parametrize("ttype", [TensorType.Q8_0, TensorType.Q4_K, TensorType.F16], ids=lambda t: t.name)
def test_pack_makes_no_float32_copy(ttype: TensorType) -> None:
    rows, cols = 512, 1024
    data = quantize(ttype, np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32))
    tracemalloc.start()
    weight = pack(RawTensor("w", ttype, (rows, cols), data))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < rows * cols * 4 // 50  # a float32 copy would be 2 MiB; views cost a few hundred bytes
    assert np.shares_memory(weight.u8, data) and not weight.u8.flags.writeable


@pytest.mark.parametrize("ttype", [TensorType.Q8_0, TensorType.Q4_K, TensorType.Q6_K, TensorType.BF16],
                         ids=lambda t: t.name)
def test_pack_reads_a_read_only_memmap(tmp_path: Path, ttype: TensorType) -> None:
    """Loaders hand over read-only np.memmap views of the file; pack and the kernels use them in place."""
    rows, cols = 33, 512
    w = np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32)
    data = quantize(ttype, w)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=data.dtype, mode="r", shape=data.shape)
    weight = pack(RawTensor("w", ttype, (rows, cols), mapped))
    assert np.shares_memory(weight.u8, mapped)
    w64 = dequantize(ttype, data, cols).astype(np.float64)
    for n in (1, 5):
        x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
        assert_product_close(matmul(x, weight), x, w64, ttype)
    np.testing.assert_array_equal(embedding(weight, np.array([3, 32])), w64[[3, 32]].astype(np.float32))


def test_pack_flattens_leading_dimensions() -> None:
    data = quantize(TensorType.Q8_0, np.ones((6, 64), np.float32)).reshape(2, 3, row_bytes(TensorType.Q8_0, 64))
    weight = pack(RawTensor("w", TensorType.Q8_0, (2, 3, 64), data))
    assert (weight.rows, weight.cols) == (6, 64) and weight.u8.shape == (6, 68)


@pytest.mark.parametrize("ttype", sorted(qm.INT8_TYPES), ids=lambda t: t.name)
def test_a_decode_rows_result_does_not_depend_on_the_other_rows(ttype: TensorType, monkeypatch) -> None:
    """Batching must not change a sequence's tokens: each decode row's product is bit-identical
    whether it runs alone (serial kernel), in a batch of any size (every tile shape; parallel
    kernel), or beside prompt rows."""
    weight, _ = make_weight(ttype, 37, 512)  # 37 rows: whole and partial row groups
    rng = np.random.default_rng(3)
    x = rng.standard_normal((11, 512)).astype(np.float32)
    monkeypatch.setattr(twin, "FORCE", "serial")
    alone = np.stack([matmul(x[t], weight, True) for t in range(11)])
    monkeypatch.setattr(twin, "FORCE", "parallel")
    for n in (2, 3, 4, 5, 8, 11):
        np.testing.assert_array_equal(matmul(x[:n], weight, np.ones(n, bool)), alone[:n])
    mixed = np.arange(11) % 3 == 0
    np.testing.assert_array_equal(matmul(x, weight, mixed)[mixed], alone[mixed])


@pytest.mark.parametrize("ttype", [TensorType.Q8_0, TensorType.Q4_K, TensorType.Q6_K, TensorType.F32],
                         ids=lambda t: t.name)
def test_a_prompt_rows_result_does_not_depend_on_the_other_rows(ttype: TensorType, monkeypatch) -> None:
    """Prompt rows too: their last bits feed the decode rows' int8 quantization, which would turn a
    batch-dependent rounding into a visible difference. F32 weights too (BLAS's sums followed n on
    an AVX2 machine: a hybrid model's prompt logits then depended on how steps cut the prompt)."""
    weight, _ = make_weight(ttype, 37, 512)
    x = np.random.default_rng(6).standard_normal((11, 512)).astype(np.float32)
    alone = np.stack([matmul(x[t], weight) for t in range(11)])
    for n in (2, 3, 4, 5, 8, 11):
        np.testing.assert_array_equal(matmul(x[:n], weight), alone[:n])
        np.testing.assert_array_equal(matmul(x[11 - n:], weight), alone[11 - n:])
    mixed = np.arange(11) % 3 == 0
    np.testing.assert_array_equal(matmul(x, weight, mixed)[~mixed], alone[~mixed])
    gate, up = make_weight(ttype, 40, 512, seed=1)[0], make_weight(ttype, 40, 512, seed=2)[0]
    monkeypatch.setattr(twin, "FORCE", "serial")
    fused = np.stack([qm.swiglu_matmul(x[t], gate, up, True) for t in range(11)])
    monkeypatch.setattr(twin, "FORCE", "parallel")
    np.testing.assert_array_equal(qm.swiglu_matmul(x, gate, up, mixed)[mixed], fused[mixed])


def test_kernels_release_the_gil() -> None:
    """The daemon's event loop runs beside these kernels: every jitted entry point must be nogil."""
    twins = (qm._MATMUL_INT8, qm._MATMUL_INT8_MANY, qm._SWIGLU_INT8, qm._MATMUL_F32)
    twins += (qm._GATHER_ROWS,)
    for kernel in (qm._matvec_16bit, qm._matmul, *(v for t in twins for v in (t.serial, t.parallel))):
        assert kernel.targetoptions.get("nogil") is True


@pytest.mark.parametrize("types", [(TensorType.Q8_0,) * 3, (TensorType.Q4_K, TensorType.Q4_K, TensorType.Q6_K),
                                   (TensorType.Q8_0, TensorType.F16, TensorType.Q8_0),
                                   (TensorType.Q4_0, TensorType.IQ4_XS, TensorType.Q3_K),
                                   (TensorType.Q2_K, TensorType.Q5_1, TensorType.IQ4_NL)], ids=lambda t: "-".join(x.name for x in t))
def test_matmul_many_equals_separate_matmuls(types: tuple[TensorType, ...]) -> None:
    """q, k and v in one kernel: bit for bit what three matmuls give, for decode, prompt and mixed rows."""
    weights = [make_weight(t, rows, 512, seed=rows)[0] for t, rows in zip(types, (96, 32, 32))]
    x = np.random.default_rng(4).standard_normal((6, 512)).astype(np.float32)
    for rows in (None, np.ones(6, bool), np.arange(6) % 2 == 0):
        for got, w in zip(qm.matmul_many(x, tuple(weights), rows), weights, strict=True):
            np.testing.assert_array_equal(got, matmul(x, w, rows))
    for got, w in zip(qm.matmul_many(x[0], tuple(weights), True), weights, strict=True):  # a vector
        np.testing.assert_array_equal(got, matmul(x[0], w, True))


@pytest.mark.parametrize("types", [(TensorType.Q8_0, TensorType.Q8_0), (TensorType.Q4_K, TensorType.Q6_K),
                                   (TensorType.BF16, TensorType.BF16), (TensorType.Q4_0, TensorType.Q3_K),
                                   (TensorType.IQ4_XS, TensorType.Q5_0)], ids=lambda t: "-".join(x.name for x in t))
def test_swiglu_matmul_equals_its_parts(types: tuple[TensorType, TensorType]) -> None:
    gate, up = (make_weight(t, 40, 256, seed=k)[0] for k, t in enumerate(types))
    x = np.random.default_rng(5).standard_normal((5, 256)).astype(np.float32)
    for rows in (None, np.ones(5, bool), np.arange(5) < 2):
        g, u = matmul(x, gate, rows), matmul(x, up, rows)
        np.testing.assert_allclose(qm.swiglu_matmul(x, gate, up, rows), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
