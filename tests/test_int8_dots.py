"""kernels/cpu/int8_dots.py against numpy: the activation quantizer bit for bit against
kernels/convert.py's q8_0 (ggml's quantize_row_q8_0_ref), and each weight type's integer row dot
against dequantize(W) @ x_hat in float64 (x_hat: x after the q8_0 round trip)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from ember.kernels.convert import f16_bits_to_f32, quantize_q8_0_split, quantize_q8_k_split
from ember.kernels.cpu import int8_dots
from ember.kernels.cpu.quant_matmul import INT8_TYPES
from ember.kernels.reference.quant import dequantize, quantize
from ember.kernels.tensor_types import TensorType
from test_quant_reference import random_blocks

pytestmark = pytest.mark.slow


def quantized(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xq = np.empty(x.size, np.int8)
    xd = np.empty(x.size // 32, np.float32)
    xs = np.empty(x.size // 32, np.float32)
    int8_dots.quantize_activation(np.ascontiguousarray(x, np.float32), xq, xd, xs)
    return xq, xd, xs


def hostile_blocks() -> np.ndarray:
    rng = np.random.default_rng(0)
    blocks = [
        np.zeros(32),                                   # all zero: d = 0, every quant 0
        np.linspace(-1, 1, 32) * 127,                   # integers: exact levels
        (np.arange(32) - 15.5),                         # x / d lands on halves: ties away from zero
        np.full(32, 1e-30),                             # tiny: 1/d overflows nothing, d rounds to 0 in f16
        np.full(32, 3e38),                              # huge: d beyond f16's range
        np.where(np.arange(32) == 3, np.inf, 1.0),      # inf: its block's other values become 0
        rng.standard_normal(32) * 1e-4,
        rng.standard_normal(32) * 1e4,
    ]
    return np.concatenate(blocks).astype(np.float32)


@pytest.mark.parametrize("x", [np.random.default_rng(1).standard_normal(1024).astype(np.float32), hostile_blocks()],
                         ids=["random", "hostile"])
def test_quantizer_is_ggmls_q8_0(x: np.ndarray) -> None:
    xq, xd, xs = quantized(x)
    scales, quants = quantize_q8_0_split(x)
    np.testing.assert_array_equal(xq, quants)
    np.testing.assert_array_equal(xd, f16_bits_to_f32(scales))
    finite = np.isfinite(xd)
    with np.errstate(invalid="ignore"):  # inf * 0 in the inf block, excluded below
        expected = xd * quants.reshape(-1, 32).astype(np.int64).sum(axis=1)
    np.testing.assert_array_equal(xs[finite], expected[finite].astype(np.float32))


def extreme_vectors(count: int) -> list[np.ndarray]:
    """Vectors whose 32-value blocks span float32's exponents (denormal scales whose 1/d overflows,
    scales past f16's range), with zeros, infinities and values on halves of their steps: the
    quantizer's vector steps and its scalar fallback must give convert.py's bits on all of them."""
    rng = np.random.default_rng(5)
    vectors = []
    for _ in range(count):
        n = 256 * int(rng.integers(1, 5))
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-44, 38, size=n // 32).repeat(32)).astype(np.float32)
        pick = rng.random(n)
        x[pick < 0.01] = np.inf
        x[(pick >= 0.01) & (pick < 0.02)] = -np.inf
        x[(pick >= 0.02) & (pick < 0.08)] = 0
        halves = (pick >= 0.08) & (pick < 0.14)
        x[halves] = np.round(x[halves]) + np.float32(0.5)
        vectors.append(x)
    return vectors


def test_quantizers_match_the_references_on_extreme_scales() -> None:
    for x in extreme_vectors(120):
        with np.errstate(all="ignore"):
            xq, xd, xs = quantized(x)
            scales, quants = quantize_q8_0_split(x)
            np.testing.assert_array_equal(xq, quants)
            np.testing.assert_array_equal(xd, f16_bits_to_f32(scales))
            np.testing.assert_array_equal(xs, (xd * quants.reshape(-1, 32).astype(np.int64).sum(axis=1)).astype(np.float32))
            kq, kd, ks = np.empty(x.size, np.int8), np.empty(x.size // 256, np.float32), np.empty(x.size // 32, np.float32)
            int8_dots.quantize_activation_k(x, kq, kd, ks)
            scales, quants = quantize_q8_k_split(x)
            np.testing.assert_array_equal(kq, quants)
            np.testing.assert_array_equal(kd, scales)
            np.testing.assert_array_equal(
                ks, (np.repeat(scales, 8) * quants.reshape(-1, 32).astype(np.int64).sum(axis=1)).astype(np.float32))


@pytest.mark.parametrize("k_quants", [False, True], ids=["q8_0", "q8_K"])
def test_quad_offsets_are_the_quads_and_sixteens_sums(k_quants: bool) -> None:
    xq = np.random.default_rng(6).integers(-128, 128, 2048).astype(np.int8)
    xq[:64] = -128  # the extreme sums: 16 x -128 = -2048 fits the int16 halves
    xc = np.empty(int8_dots.offsets_width(xq.size, k_quants), np.int32)
    offset = int8_dots.Q6_K_OFFSET if k_quants else int8_dots.Q8_0_OFFSET
    int8_dots.quad_offsets(xq, xc, offset)
    np.testing.assert_array_equal(xc[:512], -offset * xq.reshape(-1, 4).astype(np.int64).sum(axis=1))
    if k_quants:
        sixteens = xq.reshape(-1, 2, 16).astype(np.int64).sum(axis=2)
        np.testing.assert_array_equal(xc[512:].view(np.int16).reshape(-1, 2), sixteens)


ONE_BY_ONE = int8_dots.TILE_SIZES.index(1)  # one row, one token
TYPES = sorted(INT8_TYPES)
Q8_0_ACTIVATIONS = [t for t in TYPES if t.name.endswith(("_0", "_1", "NL"))]  # 32-value blocks


def _row_dots_kernel(tile):
    @njit
    def dots(w, xq, xd, xs, xc, out):
        """Row r . token 0 for every row, through a type's 1 x 1 tile."""
        for r in range(out.shape[0]):
            out[r] = tile(w, r, xq, xd, xs, xc, 0)[0]

    return dots


_DOTS = {t: _row_dots_kernel(getattr(int8_dots, f"{t.name}_TILES")[ONE_BY_ONE]) for t in TYPES}


def row_dots(ttype: TensorType, data: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kernel's row dots with x, x_hat as float64): q8_0 activations for 32-value blocks, q8_K for
    K-quants."""
    if ttype in Q8_0_ACTIVATIONS:
        xq, xd, xs = quantized(x)
        x_hat = (xq.reshape(-1, 32) * xd[:, None].astype(np.float64)).reshape(-1)
    else:
        xq, xd, xs = np.empty(x.size, np.int8), np.empty(x.size // 256, np.float32), np.empty(x.size // 32, np.float32)
        int8_dots.quantize_activation_k(np.ascontiguousarray(x, np.float32), xq, xd, xs)
        x_hat = (xq.reshape(-1, 256) * xd[:, None].astype(np.float64)).reshape(-1)
    xc = np.empty(int8_dots.offsets_width(x.size, ttype not in Q8_0_ACTIVATIONS), np.int32)
    int8_dots.quad_offsets(xq, xc, int8_dots.Q8_0_OFFSET if ttype in Q8_0_ACTIVATIONS else int8_dots.Q6_K_OFFSET)
    out = np.empty(data.shape[0], np.float32)
    _DOTS[ttype](data, xq[None], xd[None], xs[None], xc[None], out)
    return out, x_hat


def test_k_quant_activations_match_the_reference() -> None:
    """quantize_activation_k equals convert.quantize_q8_k_split, and its 32-value sums are x_hat's."""
    x = np.concatenate([np.random.default_rng(2).standard_normal(768), hostile_blocks()[:256]]).astype(np.float32)
    xq, xd, xs = np.empty(x.size, np.int8), np.empty(x.size // 256, np.float32), np.empty(x.size // 32, np.float32)
    int8_dots.quantize_activation_k(x, xq, xd, xs)
    scales, quants = quantize_q8_k_split(x)
    np.testing.assert_array_equal(xq, quants)
    np.testing.assert_array_equal(xd, scales)
    with np.errstate(invalid="ignore"):  # inf * 0 in the block holding an inf, excluded below
        expected = (np.repeat(scales, 8) * quants.reshape(-1, 32).astype(np.int64).sum(axis=1)).astype(np.float32)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(xs[finite], expected[finite])


@pytest.mark.parametrize("ttype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [256, 512, 768, 1280])
def test_row_dots_equal_the_reference(ttype: TensorType, cols: int) -> None:
    rng = np.random.default_rng(cols)
    w = rng.standard_normal((9, cols)).astype(np.float32)
    data = np.ascontiguousarray(quantize(ttype, w)).view(np.uint8).reshape(9, -1)
    x = (rng.standard_normal(cols) * rng.uniform(0.01, 10, cols)).astype(np.float32)  # blocks of mixed scale
    out, x_hat = row_dots(ttype, data, x)
    w64 = dequantize(ttype, data, cols).astype(np.float64)
    bound = 2e-6 * (np.abs(w64) @ np.abs(x_hat))  # float32 rounding of <= 1280 terms, summed in trees
    assert np.all(np.abs(out - w64 @ x_hat) <= bound), np.abs(out - w64 @ x_hat) / bound


@pytest.mark.parametrize("ttype", TYPES, ids=lambda t: t.name)
def test_row_dots_of_random_blocks_equal_the_reference(ttype: TensorType) -> None:
    """Random bytes are valid blocks: every code, scale and min (the extremes a quantizer rarely
    writes: IQ4_XS's scale -32, Q3_K's level -4 under scale -32, Q2_K's min 15)."""
    rng = np.random.default_rng(int(ttype))
    cols = 768
    data = random_blocks(ttype, 11, cols, rng)
    x = (rng.standard_normal(cols) * rng.uniform(0.01, 10, cols)).astype(np.float32)
    out, x_hat = row_dots(ttype, data, x)
    w64 = dequantize(ttype, data, cols).astype(np.float64)
    bound = 2e-6 * (np.abs(w64) @ np.abs(x_hat))
    assert np.all(np.abs(out - w64 @ x_hat) <= bound), np.abs(out - w64 @ x_hat) / bound


@pytest.mark.parametrize("blocks", [1, 3, 4, 5, 7, 12])
def test_q8_0_rows_of_any_block_count(blocks: int) -> None:
    """Q8_0 rows run in units of 4 blocks, then a tail of 0-3 single blocks."""
    rng = np.random.default_rng(blocks)
    cols = 32 * blocks
    data = np.ascontiguousarray(quantize(TensorType.Q8_0, rng.standard_normal((3, cols)).astype(np.float32)))
    data = data.view(np.uint8).reshape(3, -1)
    out, x_hat = row_dots(TensorType.Q8_0, data, rng.standard_normal(cols).astype(np.float32))
    np.testing.assert_allclose(out, dequantize(TensorType.Q8_0, data, cols) @ x_hat, rtol=1e-5, atol=1e-5)


_PRODUCTS = """
import sys
import numpy as np
from ember.kernels.cpu import int8_dots
from ember.kernels.cpu.quant_matmul import INT8_TYPES, matmul, pack
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference.quant import quantize
from ember.kernels.tensor_types import TensorType
assert (int8_dots._VNNI, int8_dots._AVX2) == {flags}, (int8_dots._VNNI, int8_dots._AVX2)
rng = np.random.default_rng(0)
x = rng.standard_normal((9, 512)).astype(np.float32)
out = []
for t in sorted(INT8_TYPES):
    w = rng.standard_normal((37, 512)).astype(np.float32)
    w[0, :32] = -127 * np.abs(w).max() / 127  # a block whose quants reach -127 (the sign trick's edge)
    weight = pack(RawTensor("w", t, (37, 512), quantize(t, w)))
    # 5 decode rows: in lanes with VNNI, in the decode tiles with AVX2; 9: 8 in lanes, 1 in the tiles
    out.append(matmul(x[:5], weight, True))
    out.append(matmul(x, weight, True))
    out.append(matmul(x[:5], weight, False, int8_prompts=True))  # int8_prompt.py's tile
sys.stdout.buffer.write(np.concatenate([o.ravel() for o in out]).tobytes())
"""


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_every_instruction_path_gives_the_same_bits(path: str, tmp_path: Path) -> None:
    """The CPU picks vpdpbusd, vpmaddubsw + vpmaddwd or portable IR (the decode tiles, the decode lanes
    and the int8 prompt product); each must give bit-identical products (the integers are exact and the float operations the same), which is how the paths
    this machine does not take by default are tested on it."""
    from ember.kernels.cpu.int8_dots import _AVX2, _VNNI

    if path == "avx2" and not _AVX2:
        pytest.skip("no AVX2 on this CPU")

    def products(env_path: str, flags: tuple[bool, bool]) -> bytes:
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / (env_path or "default")), "EMBER_INT8_PATH": env_path}
        done = subprocess.run([sys.executable, "-c", _PRODUCTS.format(flags=flags)], env=env, capture_output=True,
                              timeout=600, check=False)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return done.stdout

    default = products("", (_VNNI, _AVX2))
    assert products(path, (False, path == "avx2")) == default
