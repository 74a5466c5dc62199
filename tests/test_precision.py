"""Precision policies (daemon/planning/precision.py) and the row conversions behind them (kernels/convert.py):
bit-exact against numpy, torch and gguf-py where those define the format, bounded round-trip error,
and the choice of dtypes from devices, config, environment and flags."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from ember.daemon.planning.precision import (DeviceCaps, PrecisionError, PrecisionSettings, StagedRows, auto_act_dtype,
                                    resolve_policy)
from ember.kernels.convert import decode_rows, encode_rows, quantize_q8_0, storage_bytes
from ember.kernels.reference.quant import dequantize
from ember.kernels.reference.dense import rmsnorm
from ember.kernels.tensor_types import TensorType

RNG = np.random.default_rng(7)


def rows(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


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
    assert (p.act, p.feature, p.kv) == ("f32", "f32", "f32")
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
