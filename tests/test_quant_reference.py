"""kernels/reference/quant.py: dequantize against gguf-py (the oracle), the quantizers' error, and the
types with one right answer (F16, BF16, Q8_0) quantized to gguf-py's bytes exactly.

Random bytes are valid blocks of every type once their f16 scale fields hold finite values, so
dequantize is checked bit for bit on random blocks, and on the quantizers' own output.
"""
from __future__ import annotations

import ctypes
import os

import gguf
import numpy as np
import pytest

from ember.kernels.reference.quant import dequantize, quantize
from ember.kernels.tensor_types import BLOCK_GEOMETRY, TensorType, row_bytes

QUANTIZED = [t for t in TensorType if t not in (TensorType.F32, TensorType.F16, TensorType.BF16)]
ALL_TYPES = [TensorType.F32, TensorType.F16, TensorType.BF16, *QUANTIZED]
# Byte offsets of the f16 fields inside one block (d, and dmin or m where the type has one).
F16_FIELDS = {TensorType.Q8_0: [0], TensorType.Q4_K: [0, 2], TensorType.Q5_K: [0, 2], TensorType.Q6_K: [208],
              TensorType.Q4_0: [0], TensorType.Q4_1: [0, 2], TensorType.Q5_0: [0], TensorType.Q5_1: [0, 2],
              TensorType.IQ4_NL: [0], TensorType.Q2_K: [80, 82], TensorType.Q3_K: [108], TensorType.IQ4_XS: [0]}
# The types whose reference quantizer is ggml's, bit for bit (gguf-py mirrors it).
EXACT = [TensorType.F16, TensorType.BF16, TensorType.Q8_0, TensorType.Q4_0, TensorType.Q4_1, TensorType.Q5_0,
         TensorType.Q5_1]
# RMS error of quantize -> dequantize relative to the weights' RMS, for N(0, 1) weights 64 x 512.
# Measured: Q4_K 0.0714, Q5_K 0.0362, Q6_K 0.0177, the same as llama.cpp's own reference quantizer on
# the same data (0.0715, 0.0361, 0.0177); Q2_K 0.283, Q3_K 0.154, IQ4_NL 0.0766, IQ4_XS 0.0772 (llama.cpp,
# 256 x 768 with outliers, test_quantizer_matches_llama_cpp's data: 0.332, 0.162, 0.0882, 0.0897 to
# ours 0.314, 0.164, 0.0882, 0.0896). Bounds: measured + ~10%.
K_QUANT_RMS_BOUND = {TensorType.Q4_K: 0.079, TensorType.Q5_K: 0.040, TensorType.Q6_K: 0.0195, TensorType.Q2_K: 0.31,
                     TensorType.Q3_K: 0.17, TensorType.IQ4_NL: 0.085, TensorType.IQ4_XS: 0.085}


def oracle(ttype: TensorType, data: np.ndarray, cols: int) -> np.ndarray:
    """gguf-py's dequantize, fed the storage in the byte layout it expects."""
    qtype = gguf.GGMLQuantizationType(int(ttype))
    if ttype == TensorType.F32:
        raw = data
    elif ttype == TensorType.F16:
        raw = data.view(np.float16)
    else:  # BF16 and block types: gguf-py works on the raw bytes of each row
        raw = np.ascontiguousarray(data).view(np.uint8)
    return np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(-1, cols)


def random_storage(ttype: TensorType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid storage: random bits everywhere, finite values in every float field."""
    if ttype == TensorType.F32:
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if ttype in (TensorType.F16, TensorType.BF16):
        bits = rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint32).astype(np.uint16)
        exp_mask = 0x7C00 if ttype == TensorType.F16 else 0x7F80
        return np.where((bits & exp_mask) == exp_mask, bits & ~np.uint16(0x4000), bits).astype(np.uint16)
    block_values, block_bytes = BLOCK_GEOMETRY[ttype]
    blocks = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint16).astype(np.uint8)
    for offset in F16_FIELDS[ttype]:
        # Any finite f16, subnormals included (exponent field 0..30).
        h = rng.integers(0, 1 << 16, blocks.shape[0], dtype=np.uint32).astype(np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & ~np.uint16(0x4000), h).astype(np.uint16)
        blocks[:, offset:offset + 2] = h.reshape(-1, 1).view(np.uint8)
    return blocks.reshape(rows, row_bytes(ttype, cols))


def random_blocks(ttype: TensorType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks whose values are of order 1: random bits, f16 fields N(0, 1) / 64 (a
    random f16 scale of up to 65504 would make a dot's rounding bound meaningless)."""
    data = random_storage(ttype, rows, cols, rng)
    blocks = data.reshape(-1, BLOCK_GEOMETRY[ttype][1])
    for offset in F16_FIELDS[ttype]:
        scale = (rng.standard_normal(blocks.shape[0]) / 64).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2) / np.mean(b.astype(np.float64) ** 2)))


# --- dequantize == gguf-py, bit for bit ---------------------------------------------------------------
@pytest.mark.parametrize("ttype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 2), (300, 1), (5, 4)])
def test_dequantize_random_blocks_equals_gguf(ttype: TensorType, rows: int, blocks: int) -> None:
    cols = blocks * max(256, BLOCK_GEOMETRY[ttype][0])
    data = random_storage(ttype, rows, cols, np.random.default_rng(rows * 31 + blocks))
    ours = dequantize(ttype, data, cols)
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, oracle(ttype, data, cols))


@pytest.mark.parametrize("ttype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_of_quantizer_output_equals_gguf(ttype: TensorType) -> None:
    w = np.random.default_rng(1).standard_normal((17, 512)).astype(np.float32)
    data = quantize(ttype, w)
    np.testing.assert_array_equal(dequantize(ttype, data, 512), oracle(ttype, data, 512))


# --- quantize: storage shape and error ---------------------------------------------------------------
@pytest.mark.parametrize("ttype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(1, 256), (1, 1024), (300, 256), (7, 768)])
def test_quantize_storage_convention(ttype: TensorType, rows: int, cols: int) -> None:
    data = quantize(ttype, np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32))
    expected = {TensorType.F32: (np.float32, cols), TensorType.F16: (np.uint16, cols),
                TensorType.BF16: (np.uint16, cols)}.get(ttype, (np.uint8, row_bytes(ttype, cols)))
    assert data.dtype == expected[0] and data.shape == (rows, expected[1])


@pytest.mark.parametrize("ttype", EXACT, ids=lambda t: t.name)
def test_exact_quantizers_equal_gguf_bytes(ttype: TensorType) -> None:
    """F16, BF16 and Q8_0 have one right answer (ggml's, which gguf-py mirrors), ties, subnormals,
    infinities and NaNs included; the reference gives it through kernels/convert.py. Q4_0, Q4_1, Q5_0
    and Q5_1 are ggml's reference quantizers, bit for bit on finite weights."""
    rng = np.random.default_rng(8)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    w[0, :8] = [2.5, -2.5, 0.5, -0.5, 127.0, 0.0, -0.0, 1e-40]  # q8_0 d = 1: roundf's ties
    w[2, :32] = 1e-39  # a block whose 1 / d overflows
    w[4, :32] = 0.0
    w[5, :32] = 3.0  # a constant block: q4_1's step is 0
    if ttype in (TensorType.F16, TensorType.BF16, TensorType.Q8_0):
        w[1, :4] = [np.inf, -np.inf, np.nan, 3.4028235e38]
        w[3] = rng.integers(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32).view(np.float32)  # any bit pattern
    with np.errstate(all="ignore"):  # gguf-py warns about the non-finite blocks
        theirs = np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(ttype))))
    ours = quantize(ttype, w)
    np.testing.assert_array_equal(ours.view(np.uint8), theirs.view(np.uint8))


def test_q8_0_error_is_half_a_step() -> None:
    """Per block |err| <= d/2 from rounding, plus |q| <= 127 times d's f16 rounding (2^-11 relative)."""
    w = np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32)
    w[:, 7] *= 20  # an outlier column: its blocks get a coarse step, the rest keep theirs
    err = np.abs(dequantize(TensorType.Q8_0, quantize(TensorType.Q8_0, w), 1024) - w).reshape(-1, 32)
    step = np.abs(w).reshape(-1, 32).max(axis=1) / 127
    assert np.all(err.max(axis=1) <= step * (0.5 + 127 * 2.0**-11) + 1e-12)


@pytest.mark.parametrize("ttype", list(K_QUANT_RMS_BOUND), ids=lambda t: t.name)
def test_k_quant_rms_error(ttype: TensorType) -> None:
    w = np.random.default_rng(4).standard_normal((64, 512)).astype(np.float32)
    assert rel_rms(dequantize(ttype, quantize(ttype, w), 512), w) < K_QUANT_RMS_BOUND[ttype]


@pytest.mark.parametrize("ttype,rel,absolute", [(TensorType.F16, 2.0**-11, 2.0**-25), (TensorType.BF16, 2.0**-8, 0.0)],
                         ids=["F16", "BF16"])
def test_16bit_round_to_nearest(ttype: TensorType, rel: float, absolute: float) -> None:
    """Half an ulp: 2^-11 (F16) or 2^-8 (BF16) relative; f16 subnormals (< 2^-14) have a fixed step 2^-24."""
    w = np.random.default_rng(5).standard_normal((8, 256)).astype(np.float32)
    back = dequantize(ttype, quantize(ttype, w), 256)
    assert np.all(np.abs(back - w) <= rel * np.abs(w) + absolute)


@pytest.mark.parametrize("ttype", QUANTIZED, ids=lambda t: t.name)
def test_quantize_degenerate_rows(ttype: TensorType) -> None:
    """All-zero rows come back exactly zero; constant and one-spike rows keep their large values."""
    cols = 256
    w = np.zeros((4, cols), np.float32)
    w[1] = 0.75
    w[2, 100] = 5.0
    w[3] = -np.linspace(0.0, 3.0, cols, dtype=np.float32)
    back = dequantize(ttype, quantize(ttype, w), cols)
    assert np.all(np.isfinite(back))
    np.testing.assert_array_equal(back[0], 0.0)
    assert abs(back[2, 100] - 5.0) < 0.05 * 5.0
    assert np.abs(back[1] - 0.75).max() < 0.05 and np.abs(back[3] - w[3]).max() < 0.25


def test_quantize_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError):
        quantize(TensorType.Q4_K, np.zeros((2, 300), np.float32))


# --- against llama.cpp's own quantizer (when llama-cpp-python is installed) ----------------------------
def _ggml_quantize_chunk():
    llama_cpp = pytest.importorskip("llama_cpp")
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in ("libggml-base.so", "libggml.so", "libllama.so"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path) and hasattr(lib := ctypes.CDLL(path), "ggml_quantize_chunk"):
            fn = lib.ggml_quantize_chunk
            fn.restype = ctypes.c_size_t
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_int64, ctypes.c_void_p]
            return fn
    pytest.skip("no ggml_quantize_chunk in llama_cpp's libraries")


@pytest.mark.oracle
@pytest.mark.parametrize("ttype", QUANTIZED, ids=lambda t: t.name)
def test_quantizer_matches_llama_cpp(ttype: TensorType) -> None:
    """Same blocks as ggml's reference quantizer up to float summation order, same error; where the
    scale search is a simpler one (Q2_K, Q3_K, IQ4_NL, IQ4_XS, see the module) the error within 2%."""
    quantize_chunk = _ggml_quantize_chunk()
    rows, cols = 256, 768
    w = np.random.default_rng(6).standard_normal((rows, cols)).astype(np.float32)
    w[:, :5] *= 8  # outliers exercise the scale search
    theirs = np.zeros((rows, row_bytes(ttype, cols)), np.uint8)
    quantize_chunk(int(ttype), w.ctypes.data, theirs.ctypes.data, 0, rows, cols, None)
    ours = quantize(ttype, w)
    simpler = ttype in (TensorType.Q2_K, TensorType.Q3_K, TensorType.IQ4_NL, TensorType.IQ4_XS)
    assert np.mean(ours == theirs) > (0.6 if simpler else 0.99)
    ours_err = rel_rms(dequantize(ttype, ours, cols), w)
    theirs_err = rel_rms(dequantize(ttype, theirs, cols), w)
    assert ours_err <= theirs_err * (1.02 if simpler else 1.01)
