"""kernels/cpu/decode_lanes.py: batched decode rows in token lanes, bit for bit the decode tiles' results.

The oracle is the decode tile itself (int8_dots, checked against dequantize(W) @ x_hat in
test_int8_dots): a decode row's product must not depend on how many rows share its step, so the lanes
must give each token exactly the bits its row gives alone. The lanes are filled and multiplied here
directly (room_for), so the test runs on every CPU: 8 lanes in vpdpbusd with AVX-512 VNNI, in AVX2's
signed pairs without it, in portable IR with neither. Where the lanes are used
(VNNI or AVX2), test_quant_matmul's batches take them through the drivers too, and the last test here
a batch that the lanes and the tiles share.
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.cpu import decode_lanes, int8_dots
from ember.kernels.cpu.quant_matmul import matmul, pack
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference.quant import quantize
from ember.kernels.tensor_types import TensorType
from test_quant_reference import random_blocks

TYPES = sorted(decode_lanes.LANE_TYPES)


def lanes_product(u8: np.ndarray, ttype: TensorType, x: np.ndarray, first: int = 0, end: int | None = None) -> np.ndarray:
    """The lanes' product of x's tokens with rows first..end-1, whatever MIN_TOKENS says."""
    n, cols = x.shape
    end = u8.shape[0] if end is None else end
    lanes = decode_lanes.room_for(n, cols)
    for t in range(n):
        xq, xd, xs = np.empty(cols, np.int8), np.empty(cols // 32, np.float32), np.empty(cols // 32, np.float32)
        int8_dots.quantize_activation(x[t], xq, xd, xs)
        decode_lanes.put_token(xq, xd, xs, t, lanes)
    out = np.full((n, u8.shape[0]), np.nan, np.float32)
    decode_lanes.rows(int(ttype), u8, first, end, lanes, out)
    return out


def alone(weight, x: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Each token's decode row through the decode tiles, one token a call."""
    return np.stack([matmul(x[t:t + 1], weight, True)[0] for t in range(x.shape[0])])


@pytest.mark.parametrize("ttype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [32, 96, 160, 768])  # tails of 1-3 blocks after the units of 4
def test_lanes_give_the_decode_tiles_bits(ttype: TensorType, cols: int) -> None:
    rng = np.random.default_rng(cols + int(ttype))
    rows = 11  # whole tiles of 4 (2 with mins) and single rows
    data = random_blocks(ttype, rows, cols, rng)  # every code, scale and min a file may hold (Q8_0's -128)
    weight = pack(RawTensor("w", ttype, (rows, cols), data))
    for n in (1, 4, 8, 9, 15, 16, 31):  # one vector begun or full, a second begun or full, a fourth
        x = (rng.standard_normal((n, cols)) * rng.uniform(0.01, 10, cols)).astype(np.float32)
        x[0, :32] = 0  # a block of scale 0
        np.testing.assert_array_equal(lanes_product(weight.u8, ttype, x).view(np.uint32),
                                      alone(weight, x).view(np.uint32), err_msg=f"{n} tokens")


def test_lanes_write_only_their_rows_and_tokens() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((13, 256)).astype(np.float32)
    weight = pack(RawTensor("w", TensorType.Q8_0, (13, 256), quantize(TensorType.Q8_0, w)))
    x = rng.standard_normal((6, 256)).astype(np.float32)
    out = lanes_product(weight.u8, TensorType.Q8_0, x, first=3, end=10)
    assert np.isnan(out[:, :3]).all() and np.isnan(out[:, 10:]).all()
    np.testing.assert_array_equal(out[:, 3:10], alone(weight, x)[:, 3:10])


def test_the_room_has_lanes_from_min_tokens_on() -> None:
    cols, tokens, least = 64, decode_lanes.TOKENS, decode_lanes.MIN_TOKENS
    assert decode_lanes.room(least - 1, cols).shape[0] == 0
    assert decode_lanes.room_for(tokens + 1, cols).shape[0] == 2
    if least < 1 << 20:  # a CPU with AVX-512 VNNI or AVX2
        assert decode_lanes.room(least, cols).shape[0] == 1
        # a last vector of fewer than MIN_TOKENS tokens is left to the decode tiles
        assert decode_lanes.room(tokens + least - 1, cols).shape[0] == 1
        assert decode_lanes.tokens_in(decode_lanes.room(tokens + least - 1, cols), tokens + least - 1) == tokens
        assert decode_lanes.room(tokens + least, cols).shape[0] == 2


@pytest.mark.parametrize("ttype", [TensorType.Q8_0, TensorType.Q4_1], ids=lambda t: t.name)
def test_a_batch_shared_by_lanes_and_tiles_gives_each_token_its_bits(ttype: TensorType) -> None:
    """Through the driver: whole vectors of tokens in lanes and a short last one in the decode tiles
    (on a CPU with lanes; elsewhere every token in the tiles), each token as if alone."""
    rng = np.random.default_rng(7)
    rows, cols = 37, 256
    weight = pack(RawTensor("w", ttype, (rows, cols), random_blocks(ttype, rows, cols, rng)))
    tokens = decode_lanes.TOKENS
    for n in (tokens + 1, tokens + decode_lanes.MIN_TOKENS % tokens, 2 * tokens + 2):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        np.testing.assert_array_equal(matmul(x, weight, True).view(np.uint32), alone(weight, x).view(np.uint32),
                                      err_msg=f"{n} tokens")
