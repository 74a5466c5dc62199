"""Precision policies (daemon/planning/precision.py) and the row conversions behind them (kernels/convert.py):
each conversion bit-exact against gguf-py (which mirrors ggml), a line-for-line port of ggml's f16
conversion, numpy and torch, on random bit patterns and hostile values; bounded round-trip error;
the dtype lists' one home; and the choice of dtypes from devices, config, environment and flags."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from ember.daemon.planning import precision
from ember.daemon.planning.precision import (DeviceCaps, PrecisionError, PrecisionSettings, StagedRows, auto_act_dtype,
                                    resolve_policy)
from ember.kernels import convert
from ember.kernels.convert import (bf16_bits_to_f32, decode_rows, dequantize_q8_0, encode_rows, f16_bits_to_f32,
                                   f32_to_bf16_bits, f32_to_f16_bits, quantize_q8_0, quantize_q8_0_split, storage_bytes)
from ember.kernels.cpu import paged_attention
from ember.kernels.reference.quant import dequantize
from ember.kernels.reference.dense import rmsnorm
from ember.kernels.tensor_types import TensorType

RNG = np.random.default_rng(7)
GGUF = gguf.GGMLQuantizationType
ALL_16BIT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every f16 / bf16 bit pattern


def rows(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def random_bit_patterns(n: int) -> np.ndarray:
    """float32 of n uniformly random bit patterns: every exponent is as likely as any other, so
    subnormals, infinities and NaNs of every payload turn up, which normal samples never reach."""
    return RNG.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def from_bits(*bits: int) -> np.ndarray:
    """float32 of exact bit patterns (a NaN passing through a Python float may lose its payload)."""
    return np.array(bits, np.uint32).view(np.float32)


def midpoints(values: np.ndarray) -> np.ndarray:
    """float32 halfway between consecutive float32 `values` (exact: a 16-bit format's midpoints need
    at most 12 significant bits), both signs: the ties that round-to-nearest-even must break."""
    v = values.astype(np.float64)
    mid = ((v[:-1] + v[1:]) / 2).astype(np.float32)
    return np.concatenate([mid, -mid])


def ggml_fp32_to_fp16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_fp16 (ggml/src/ggml-impl.h), ggml's portable bit trick, line for line in
    float32/uint32 numpy: an oracle of ggml's f16 rounding that shares nothing with numpy's cast."""
    f32, u32 = np.float32, np.uint32
    with np.errstate(over="ignore"):  # beyond the f16 range `base` becomes inf, as in C
        base = (np.abs(x) * f32(2.0**112)) * f32(2.0**-110)
    w = np.ascontiguousarray(x, f32).view(u32)
    shl1_w = w + w  # uint32 wraparound drops the sign bit, as in C
    sign = w & u32(0x80000000)
    bias = np.maximum(shl1_w & u32(0xFF000000), u32(0x71000000))
    base = ((bias >> u32(1)) + u32(0x07800000)).view(f32) + base
    bits = base.view(u32)
    nonsign = ((bits >> u32(13)) & u32(0x7C00)) + (bits & u32(0x0FFF))
    return ((sign >> u32(16)) | np.where(shl1_w > u32(0xFF000000), u32(0x7E00), nonsign)).astype(np.uint16)


def gguf_quantize(x: np.ndarray, qtype: GGUF) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf-py warns about the NaN/inf blocks of hostile inputs
        return gguf.quants.quantize(x, qtype)


def q8_0_hostile_blocks() -> np.ndarray:
    """float32 [n, 32], each block a case ggml's quantize_row_q8_0_ref must be matched on exactly."""
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    big = float(np.finfo(np.float32).max)
    cases = [
        [0.0] * 32,  # all zero: d = 0, id = 0
        [-0.0] * 32,
        [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5] + [0.0] * 23,  # d = 1: roundf's ties
        [254.0, 1.0, -1.0, 3.0, -3.0, 253.0] + [0.0] * 26,  # d = 2: ties at x * id = .5
        [tiny, -tiny, 1e-40] + [0.0] * 29,  # subnormals: 1 / d overflows to inf
        [1e-38, -5e-39] + [1e-45] * 30,  # amax normal, d subnormal
        [big, -big, 1e38] + [1.0] * 29,  # d overflows f16 to inf
        [65504.0 * 127] + [1.0] * 31,  # d at the top of f16
        [np.inf, -1.0, 0.5] + [0.0] * 29,  # d = inf, id = 0, inf * 0 = NaN
        [-np.inf] * 32,
        [np.nan, 2.0, -3.0] + [1.0] * 29,  # d = NaN
        [1.0] * 31 + [np.nan],  # NaN last, where ggml's MAX macro would keep it too
    ]
    blocks = np.array(cases, np.float32)
    blocks.view(np.uint32)[-1, :2] = [0x7F800001, 0xFFC00123]  # NaN payloads in both halves
    return blocks


# --- conversions ----------------------------------------------------------------------------------
def test_storage_bytes_by_hand() -> None:
    assert storage_bytes("f32", 4096) == 16384
    assert storage_bytes("f16", 4096) == 8192
    assert storage_bytes("bf16", 4096) == 8192
    assert storage_bytes("q8_0", 4096) == 128 * 34 == 4352
    assert storage_bytes("q8_0", 40) == 2 * 34  # a partial block takes a whole one
    with pytest.raises(ValueError, match="unknown storage dtype 'f8'"):
        storage_bytes("f8", 32)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("shape", [(1, 32), (3, 4096), (2, 5, 96), (4, 40), (1, 1)])
def test_encoded_size_is_storage_bytes(dtype: str, shape: tuple[int, ...]) -> None:
    data = encode_rows(rows(shape), dtype)
    assert data.nbytes == int(np.prod(shape[:-1])) * storage_bytes(dtype, shape[-1])
    assert decode_rows(data, dtype, shape[-1]).shape == shape


def test_f16_equals_numpy_and_round_trips_within_half_an_ulp() -> None:
    x = rows((8, 256), 100.0)
    bits = encode_rows(x, "f16")
    assert np.array_equal(bits, x.astype(np.float16).view(np.uint16))
    back = decode_rows(bits, "f16", 256)
    assert back.dtype == np.float32
    normal = np.abs(x) > 6.1e-5  # below: f16 subnormals, absolute error instead
    assert np.all(np.abs(back - x)[normal] <= np.abs(x)[normal] * 2.0**-11)
    assert decode_rows(encode_rows(np.array([[1e6, -1e6]], np.float32), "f16"), "f16", 2).tolist() == [[np.inf, -np.inf]]


def test_bf16_equals_torch_bit_for_bit() -> None:
    torch = pytest.importorskip("torch")
    specials = np.array([[0.0, -0.0, 1e-40, 3.4e38, np.inf, -np.inf]], np.float32)  # subnormal, overflow
    x = np.concatenate([rows((1, 4096), 3.0), specials], axis=1)
    ours = encode_rows(x, "bf16")
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)


def test_bf16_round_trip_error_and_nan() -> None:
    x = rows((4, 512), 50.0)
    back = decode_rows(encode_rows(x, "bf16"), "bf16", 512)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-8)
    # a NaN whose payload is only in the low half would round to inf without the explicit case
    nan = np.array([[np.nan]], np.float32)
    low_payload = np.array([[0x7F800001]], np.uint32).view(np.float32)
    assert np.isnan(decode_rows(encode_rows(np.concatenate([nan, low_payload], 1), "bf16"), "bf16", 2)).all()


def test_q8_0_is_ggml_block_layout_bit_for_bit() -> None:
    x = rows((6, 256), 2.0)
    x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, :32] = 0.0
    x[1, :3] = [127.0, 2.5, -2.5]  # d = 1: halves round away from zero (ggml's roundf), not to even (rint)
    ours = quantize_q8_0(x)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    assert ours.shape == (6, 8 * 34)
    assert np.array_equal(ours, theirs)
    assert ours[1].view(np.int8)[2:5].tolist() == [127, 3, -3]
    assert np.array_equal(decode_rows(ours, "q8_0", 256), dequantize(TensorType.Q8_0, ours, 256))


def test_q8_0_round_trip_error_is_half_a_step() -> None:
    x = rows((16, 4096), 3.0)
    back = decode_rows(encode_rows(x, "q8_0"), "q8_0", 4096)
    blocks = np.abs(x).reshape(16, -1, 32).max(axis=-1, keepdims=True)
    step = blocks / 127  # the scale d; stored as f16, which moves each value by up to 127 * d * 2^-11
    err = np.abs(back - x).reshape(16, -1, 32)
    assert np.all(err <= step * (0.5 + 127 * 2.0**-11) + 1e-7)


def test_q8_0_pads_partial_blocks_with_zeros() -> None:
    x = rows((3, 40))
    data = encode_rows(x, "q8_0")
    assert data.shape == (3, 68)
    padded = np.zeros((3, 64), np.float32)
    padded[:, :40] = x
    assert np.array_equal(data, quantize_q8_0(padded))
    assert decode_rows(data, "q8_0", 40).shape == (3, 40)
    with pytest.raises(ValueError, match="take 68 bytes, got 34"):
        decode_rows(data[:, :34], "q8_0", 40)


# --- each conversion against gguf-py and ggml, bit for bit -----------------------------------------
def test_f16_is_ggml_round_to_nearest_even() -> None:
    finite_f16 = ALL_16BIT[:0x7C00].view(np.float16).astype(np.float32)  # 0 .. 65504
    x = np.concatenate([random_bit_patterns(1 << 20), midpoints(np.append(finite_f16, np.float32(65536))),
                        np.array([0.0, -0.0, np.inf, -np.inf, 65519.0, 65520.0, 1e-40], np.float32),
                        from_bits(0x7F800001, 0xFFC00000, 0x7FFFFFFF)])
    ours = f32_to_f16_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], ggml_fp32_to_fp16(x[~nan]))
    # NaN stays NaN of the same sign (its payload bits are numpy's, see kernels/convert.py)
    assert np.isnan(ours[nan].view(np.float16)).all()
    np.testing.assert_array_equal(ours[nan] >> 15, x[nan].view(np.uint32) >> 31)
    np.testing.assert_array_equal(ours, gguf_quantize(x, GGUF.F16).view(np.uint16))


def test_f16_decodes_like_gguf_and_round_trips_every_pattern() -> None:
    values = f16_bits_to_f32(ALL_16BIT)
    theirs = gguf.quants.dequantize(ALL_16BIT.copy(), GGUF.F16)
    np.testing.assert_array_equal(values.view(np.uint32), theirs.view(np.uint32))
    back = f32_to_f16_bits(values)
    nan = np.isnan(values)
    np.testing.assert_array_equal(back[~nan], ALL_16BIT[~nan])
    assert np.isnan(back[nan].view(np.float16)).all()


def test_bf16_equals_gguf_bit_for_bit() -> None:
    """gguf-py's BF16 mirrors ggml_compute_fp32_to_bf16: ties to even, NaNs quieted, not carried to inf."""
    finite_bf16 = bf16_bits_to_f32(ALL_16BIT[:0x7F80])
    x = np.concatenate([random_bit_patterns(1 << 20), midpoints(finite_bf16),
                        np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, 1e-40], np.float32),
                        from_bits(0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FC00000, 0x7F7FFFFF)])
    ours = f32_to_bf16_bits(x)
    np.testing.assert_array_equal(ours, gguf_quantize(x, GGUF.BF16).view(np.uint16))
    # NaNs quieted with their top bits kept; the largest finite float32 rounds up to inf
    assert ours[-5:].tolist() == [0x7FC0, 0xFFC0, 0x7FFF, 0x7FC0, 0x7F80]


def test_bf16_decodes_like_gguf_and_round_trips_every_pattern() -> None:
    values = bf16_bits_to_f32(ALL_16BIT)
    theirs = gguf.quants.dequantize(ALL_16BIT.view(np.uint8), GGUF.BF16)
    np.testing.assert_array_equal(values.view(np.uint32), theirs.view(np.uint32))
    nan = np.isnan(values)
    expected = np.where(nan, ALL_16BIT | np.uint16(0x40), ALL_16BIT)  # exact, but NaNs come back quiet
    np.testing.assert_array_equal(f32_to_bf16_bits(values), expected)


@pytest.mark.parametrize("source", ["normal", "wide", "bit_patterns", "hostile"])
def test_q8_0_equals_gguf_bytes(source: str) -> None:
    block_scales = np.exp(RNG.uniform(-80, 80, (64, 16, 1))).astype(np.float32)  # e^+-80: near f32's ends
    x = {
        "normal": lambda: rows((64, 512)),
        "wide": lambda: (rows((64, 16, 32)) * block_scales).reshape(64, 512),
        "bit_patterns": lambda: random_bit_patterns(1 << 16).reshape(-1, 256),  # most blocks hold a NaN or inf
        "hostile": lambda: q8_0_hostile_blocks().reshape(1, -1),
    }[source]()
    ours = quantize_q8_0(x)
    np.testing.assert_array_equal(ours, gguf_quantize(x, GGUF.Q8_0))
    scales, quants = quantize_q8_0_split(x)  # the split form is the same bytes, apart
    blocks = ours.reshape(-1, 34)
    np.testing.assert_array_equal(scales.reshape(-1), blocks[:, :2].copy().view(np.uint16).reshape(-1))
    np.testing.assert_array_equal(quants.reshape(-1, 32), blocks[:, 2:].view(np.int8))


def test_q8_0_hostile_blocks_by_hand() -> None:
    """The answers gguf-py gives above, written out: what ggml's C gives where it is defined."""
    scales, quants = quantize_q8_0_split(q8_0_hostile_blocks().reshape(1, -1))
    scales, quants = scales.reshape(-1), quants.reshape(-1, 32)
    assert scales[0] == scales[1] == 0 and not quants[:2].any()  # all-zero blocks
    assert scales[2] == 0x3C00 and quants[2, :9].tolist() == [127, 3, -3, 1, -1, 2, -2, 127, -127]
    assert scales[3] == 0x4000 and quants[3, :6].tolist() == [127, 1, -1, 2, -2, 127]  # 0.5 and 1.5 away from 0
    assert scales[4] == 0 and not quants[4].any()  # 1 / d overflowed: nothing finite to store
    assert scales[6] == 0x7C00 and scales[8] == 0x7C00 and not quants[8].any()  # inf scales; inf * 0 stored 0
    assert np.isnan(scales[10:].view(np.float16)).all() and not quants[10:].any()  # NaN poisons its block


def test_q8_0_decodes_like_gguf() -> None:
    """dequantize_q8_0 on random valid blocks: random bytes, any finite f16 scale (subnormals included)."""
    blocks = RNG.integers(0, 256, (4096, 34), dtype=np.uint16).astype(np.uint8)
    d = RNG.integers(0, 1 << 16, 4096, dtype=np.uint32).astype(np.uint16)
    d = np.where((d & 0x7C00) == 0x7C00, d & ~np.uint16(0x4000), d).astype(np.uint16)  # inf/NaN -> finite
    blocks[:, :2] = d.reshape(-1, 1).view(np.uint8)
    data = blocks.reshape(64, -1)
    ours = dequantize_q8_0(data, 64 * 32)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(data, GGUF.Q8_0).reshape(64, -1))


def test_q8_0_split_needs_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 32 values, got 40"):
        quantize_q8_0_split(rows((2, 40)))


def test_dtype_lists_have_one_home() -> None:
    assert precision.KV_DTYPES is convert.KV_DTYPES
    assert precision.FEATURE_DTYPES is convert.STORAGE_DTYPES
    assert tuple(paged_attention.MODE) == convert.KV_DTYPES
    assert set(precision.ACT_DTYPES) < set(convert.STORAGE_DTYPES)


# --- choosing dtypes --------------------------------------------------------------------------------
def test_device_capabilities() -> None:
    assert DeviceCaps.of("cpu").native == ("f32",)
    assert "bf16" in DeviceCaps.of("cuda:0", (8, 0)).native
    assert "bf16" not in DeviceCaps.of("cuda:0", (7, 5)).native
    assert DeviceCaps.of("cuda:1").native == ("f16", "f32")  # unknown capability: no bf16 assumed
    with pytest.raises(PrecisionError, match="unknown device 'tpu'"):
        DeviceCaps.of("tpu")


@pytest.mark.parametrize("devices, expected", [
    ([DeviceCaps.of("cpu")], "f32"),
    ([DeviceCaps.of("cuda:0", (8, 9))], "bf16"),
    ([DeviceCaps.of("cuda:0", (7, 0))], "f16"),
    ([DeviceCaps.of("cuda:0", (9, 0)), DeviceCaps.of("cuda:1", (8, 6))], "bf16"),
    ([DeviceCaps.of("cuda:0", (8, 9)), DeviceCaps.of("cuda:1", (7, 5))], "f16"),  # common to the split
    ([DeviceCaps.of("cuda:0", (8, 9)), DeviceCaps.of("cpu")], "f32"),
])
def test_auto_activation_dtype(devices: list[DeviceCaps], expected: str) -> None:
    assert auto_act_dtype(devices) == expected
    assert resolve_policy(devices, env={}).act == expected


def test_defaults_and_sources() -> None:
    p = resolve_policy([DeviceCaps.of("cpu")], env={})
    assert (p.act, p.feature, p.kv) == ("f32", "f32", "f16")  # f16 KV, as llama.cpp's
    assert dict(p.sources) == {"act": "auto", "feature": "default", "kv": "default"}


def test_config_then_environment_then_flags() -> None:
    cpu = [DeviceCaps.of("cpu")]
    config = PrecisionSettings(act="bf16", feature="f16", kv="f16")
    env = {"EMBER_KV_DTYPE": "Q8_0", "EMBER_FEATURE_DTYPE": "", "EMBER_ACT_DTYPE": "f16"}
    p = resolve_policy(cpu, config=config, env=env, flags=PrecisionSettings(act="f32"))
    assert (p.act, p.feature, p.kv) == ("f32", "f16", "q8_0")  # CPU stays f32 unless asked, and here it's asked back
    assert dict(p.sources) == {"act": "flag", "feature": "config", "kv": "EMBER_KV_DTYPE"}
    asked = resolve_policy(cpu, env={"EMBER_ACT_DTYPE": "bf16"})
    assert (asked.act, asked.sources["act"]) == ("bf16", "EMBER_ACT_DTYPE")


def test_bad_values_name_the_setting_and_source() -> None:
    cpu = [DeviceCaps.of("cpu")]
    with pytest.raises(PrecisionError, match=r"kv dtype 'f8' \(from EMBER_KV_DTYPE\) is not one of f32, f16, bf16, q8_0"):
        resolve_policy(cpu, env={"EMBER_KV_DTYPE": "f8"})
    with pytest.raises(PrecisionError, match=r"act dtype 'q8_0' \(from flag\)"):
        resolve_policy(cpu, env={}, flags=PrecisionSettings(act="q8_0"))  # activations are never q8_0
    with pytest.raises(PrecisionError, match="no devices"):
        resolve_policy([], env={})


# --- narrow storage, f32 compute ------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [("f32", 0.0), ("f16", 2e-3), ("bf16", 1.6e-2), ("q8_0", 1.6e-2)])
def test_staged_rows_widen_to_f32_before_the_norm(dtype: str, tol: float) -> None:
    x = rows((5, 384), 4.0)
    w = rows((384,)) + 1.0
    staged = StagedRows.stage(x, dtype)
    assert staged.nbytes == 5 * storage_bytes(dtype, 384)
    widened = staged.to_compute()
    assert widened.dtype == np.float32 and widened.shape == x.shape
    # tolerance: the storage's relative precision, times the largest |w| the norm scales by
    np.testing.assert_allclose(rmsnorm(widened, w, 1e-6), rmsnorm(x, w, 1e-6), rtol=0, atol=tol * np.abs(w).max() * 4)
