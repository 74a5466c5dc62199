"""Paged KV storage in every dtype and the attention kernel reading it. K/V rows go in through
KVLayerStore.write, as the runtime writes them; what the store then holds is compared bit for bit with
references that share no code with ember (gguf-py's Q8_0; f16 and bf16 rounded by value here, in
float64), and the attention output with numpy's dense attention over those references."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from numba import njit

from ember.kernels.reference import dense as reference
from ember.kernels.cpu import paged_attention as pa
from ember.kernels.cpu import twin

rng = np.random.default_rng(5)
Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)


# --- independent references of the stored formats --------------------------------------------------
def round_by_value(x: np.ndarray, significant_bits: int, min_exponent: int, max_finite: float) -> np.ndarray:
    """float64 of x rounded to nearest, ties to even, on the grid of a binary float format: normals
    2^E * 1.f with E >= min_exponent, subnormals below with the spacing of the smallest binade, and
    +-inf beyond max_finite. By value rather than by bit tricks, so it shares nothing with ember's."""
    x64 = np.asarray(x, np.float64)
    _, e = np.frexp(x64)  # |x| = m * 2^e with m in [0.5, 1): the binade's exponent E is e - 1
    step = np.ldexp(1.0, np.maximum(e - 1, min_exponent) - (significant_bits - 1))
    with np.errstate(invalid="ignore"):  # inf / step is inf, and stays inf
        rounded = np.rint(x64 / step) * step  # the multiple's parity is the last mantissa bit's
    return np.where(np.abs(rounded) > max_finite, np.copysign(np.inf, x64), rounded)


def f16_reference(x: np.ndarray) -> np.ndarray:
    """IEEE half bits of float32 x (NaNs excepted: callers compare those as NaN)."""
    with np.errstate(invalid="ignore"):
        return round_by_value(x, 11, -14, 65504.0).astype(np.float16).view(np.uint16)


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 x; a NaN keeps its top bits with the quiet bit set, as ggml's
    GGML_FP32_TO_BF16 writes it."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    with np.errstate(invalid="ignore"):
        rounded = round_by_value(x, 8, -126, F32_MAX).astype(np.float32).view(np.uint32) >> 16
    return np.where(np.isnan(x), (bits >> 16) | 0x40, rounded).astype(np.uint16)


def reference_storage(dtype: str, rows: np.ndarray) -> np.ndarray:
    """What rows [n, kv_heads, head_dim] must be stored as: float32 values, 16-bit patterns, or for
    q8_0 gguf-py's block_q8_0 bytes [n, kv_heads, head_dim / 32 * 34]."""
    if dtype == "f32":
        return rows.copy()
    if dtype == "f16":
        return f16_reference(rows)
    if dtype == "bf16":
        return bf16_reference(rows)
    with np.errstate(all="ignore"):  # gguf-py warns about the non-finite blocks of hostile rows
        return gguf.quants.quantize(rows, Q8_0)


def reference_values(dtype: str, stored: np.ndarray) -> np.ndarray:
    """float32 of `reference_storage`'s output, decoded without ember."""
    if dtype == "f32":
        return stored
    if dtype == "f16":
        return stored.view(np.float16).astype(np.float32)
    if dtype == "bf16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return gguf.quants.dequantize(stored, Q8_0)


def stored(store: pa.KVLayerStore, dtype: str, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The store's contents at (blocks[i], offsets[i]) in reference_storage's layout."""
    values, scales = store.stored(blocks, offsets)  # scales: [n, kv_heads, head_dim / 32] f16 bits
    if dtype != "q8_0":
        return values
    quants = values.reshape(scales.shape + (32,))
    block_bytes = np.concatenate([scales[..., None].view(np.uint8), quants.view(np.uint8)], axis=-1)
    return block_bytes.reshape(scales.shape[:-1] + (-1,))


def write_scattered(store: pa.KVLayerStore, n_blocks: int, block_size: int, rows: np.ndarray):
    """Write rows through KVLayerStore.write into distinct random slots; -> (blocks, offsets)."""
    slots = rng.choice(n_blocks * block_size, size=len(rows), replace=False)
    blocks, offsets = slots // block_size, slots % block_size
    store.write(blocks, offsets, rows)
    return blocks, offsets


def hostile_rows(hkv: int, hd: int) -> np.ndarray:
    """Rows [n, hkv, hd] whose 32-value blocks are each a case the conversions must get exactly right."""
    half = np.float32(2.0**-11)  # half an f16 ulp at 1; 2^-8 is half a bf16 ulp at 1
    cases = [
        np.zeros(32),  # all zero: q8_0 d = 0 and id = 0
        [127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5, -0.0] + [0.0] * 23,  # d = 1: ties of roundf
        [1 + half, 1 + 3 * half, -(1 + half), 1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 3 * 2.0**-8), 65519.0, 65520.0,
         -65520.0, 2.0**-25, 3 * 2.0**-25, 2.0**-24 + 2.0**-26] + [0.25] * 20,  # f16/bf16 ties and overflow
        [F32_TINY, -F32_TINY, 1e-40, -3e-39, 1.2e-38] + [0.0] * 27,  # subnormals: q8_0's 1/d overflows
        [F32_MAX, -F32_MAX, 1e38] + [1.0] * 29,  # huge: d overflows f16 to inf
        [np.inf, -1.0, 0.5] + [0.0] * 29,  # inf: d = inf, id = 0, inf * 0 = NaN
        [-np.inf, np.nan, 2.0, 0.0, 0.0] + [1.0] * 27,  # NaN: d is NaN
        rng.standard_normal(32) * 1e-3,
    ]
    blocks = np.array([np.asarray(c, np.float32) for c in cases], np.float32)
    # NaNs whose payload sits in the low half (the bf16 rounding alone would carry them into inf),
    # set by bits because a NaN passing through a Python float may lose its payload
    blocks.view(np.uint32)[6, 3:5] = [0x7F800001, 0xFFA00001]
    per_row = hkv * hd // 32
    reps = -(-len(blocks) // per_row) * per_row
    return np.resize(blocks, (reps, 32)).reshape(-1, hkv, hd)


def assert_same_storage(dtype: str, got: np.ndarray, expected: np.ndarray) -> None:
    if dtype == "f16":  # NaN payloads are numpy's business (see kernels/convert.py); NaN must stay NaN
        nan = np.isnan(expected.view(np.float16))
        assert np.isnan(got.view(np.float16)[nan]).all()
        got, expected = got[~nan], expected[~nan]
    np.testing.assert_array_equal(got.view(np.uint32) if dtype == "f32" else got,
                                  expected.view(np.uint32) if dtype == "f32" else expected)


# --- tests -----------------------------------------------------------------------------------------
def test_references_by_hand() -> None:
    """The value-rounding references agree with known answers before they judge anything."""
    x = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 65519.0, 65520.0, 2.0**-25, 3 * 2.0**-25], np.float32)
    assert f16_reference(x).tolist() == [0x3C00, 0x3C02, 0x7BFF, 0x7C00, 0x0000, 0x0002]
    y = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -np.inf, F32_MAX, F32_TINY, -0.0], np.float32)
    assert bf16_reference(y).tolist() == [0x3F80, 0x3F82, 0xFF80, 0x7F80, 0x0000, 0x8000]
    low_payload_nan = np.array([0x7F800001, 0xFFC00000], np.uint32).view(np.float32)
    assert bf16_reference(low_payload_nan).tolist() == [0x7FC0, 0xFFC0]


@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("dtype", pa.KV_DTYPES)
def test_write_stores_the_reference_bits(dtype: str, keys: bool) -> None:
    n_blocks, block_size, hkv, hd = 12, 4, 2, 64
    store = pa.KVLayerStore.allocate(dtype, n_blocks, block_size, hkv, hd, keys=keys)
    rows = np.concatenate([rng.standard_normal((7, hkv, hd)).astype(np.float32) * 3, hostile_rows(hkv, hd)])
    blocks, offsets = write_scattered(store, n_blocks, block_size, rows)
    assert_same_storage(dtype, stored(store, dtype, blocks, offsets), reference_storage(dtype, rows))
    # every other slot is untouched (a block's rows sit on axis 3 of a K store, axis 2 of a V store)
    untouched = np.ones((n_blocks, block_size), bool)
    untouched[blocks, offsets] = False
    arrays = [a for a in (store.f32, store.u16, store.i8, store.scales) if a.size > 1]
    assert arrays
    for array in arrays:
        by_slot = np.moveaxis(array, 3 if keys else 2, 1)
        assert by_slot.shape[:2] == (n_blocks, block_size)
        assert not by_slot[untouched].any()


_Q8_0 = pa.MODE["q8_0"]


@njit
def _store_rows(mode, rows, f32, u16, i8, scales, blocks, offsets, keys):  # type: ignore[no-untyped-def]
    for i in range(rows.shape[0]):
        if mode == _Q8_0:
            pa.store_row_q8_0(rows[i], i8, scales, blocks[i], offsets[i], keys)
        else:
            pa.store_row(mode, rows[i], f32, u16, blocks[i], offsets[i], keys)


@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("dtype", pa.KV_DTYPES)
def test_compiled_row_store_stores_the_reference_bits(dtype: str, keys: bool) -> None:
    """The fused layers store their K/V rows in compiled code (store_row, store_row_q8_0), not
    through write: the same bits, hostile values included (ties, overflow, subnormals, infinities,
    NaN payloads; q8_0: a NaN's block, blocks too small for 1 / d)."""
    n_blocks, block_size, hkv, hd = 12, 4, 2, 64
    store = pa.KVLayerStore.allocate(dtype, n_blocks, block_size, hkv, hd, keys=keys)
    rows = np.concatenate([rng.standard_normal((7, hkv, hd)).astype(np.float32) * 3, hostile_rows(hkv, hd)])
    slots = rng.choice(n_blocks * block_size, size=len(rows), replace=False)
    blocks, offsets = slots // block_size, slots % block_size
    _store_rows(pa.MODE[dtype], rows, store.f32, store.u16, store.i8, store.scales, blocks, offsets, keys)
    assert_same_storage(dtype, stored(store, dtype, blocks, offsets), reference_storage(dtype, rows))


@pytest.mark.parametrize("dtype", pa.KV_DTYPES)
@pytest.mark.parametrize("parallel", [False, True])
def test_paged_attention_matches_dense_reference(dtype: str, parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(twin, "FORCE", "parallel" if parallel else "serial")
    block_size, hkv, hq, hd, n_blocks = 4, 2, 6, 64, 40
    k_store = pa.KVLayerStore.allocate(dtype, n_blocks, block_size, hkv, hd, keys=True)
    v_store = pa.KVLayerStore.allocate(dtype, n_blocks, block_size, hkv, hd, keys=False)
    lengths = [1, 7, 13, 30]  # sequences of different lengths, blocks scattered over the pool
    perm = rng.permutation(n_blocks)
    tables = np.zeros((len(lengths), 8), np.int32)
    keys, values, used = [], [], 0
    for s, n in enumerate(lengths):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[used : used + nb]
        used += nb
        k, v = rng.standard_normal((n, hkv, hd)).astype(np.float32), rng.standard_normal((n, hkv, hd)).astype(np.float32)
        pos = np.arange(n)
        k_store.write(tables[s, pos // block_size], pos % block_size, k)
        v_store.write(tables[s, pos // block_size], pos % block_size, v)
        keys.append(reference_values(dtype, reference_storage(dtype, k)))
        values.append(reference_values(dtype, reference_storage(dtype, v)))
    # the step: the last 3 tokens of sequence 3 (a prefill chunk) and the last token of the others
    token_seq = np.array([0, 1, 2, 3, 3, 3], np.int32)
    positions = np.array([0, 6, 12, 27, 28, 29])
    q = rng.standard_normal((6, hq, hd)).astype(np.float32)
    got = pa.paged_attention(q, k_store, v_store, tables, token_seq, positions, hd**-0.5)
    for i, (s, p) in enumerate(zip(token_seq, positions)):
        k, v = keys[s].transpose(1, 0, 2), values[s].transpose(1, 0, 2)  # [hkv, T, hd]
        expected = reference.attention(q[i : i + 1], k, v, int(p), hd**-0.5)
        np.testing.assert_allclose(got[i : i + 1], expected, rtol=1e-4, atol=2e-5)


def _dtypes_and_shapes(shapes: list[tuple[int, int, int]]) -> list[tuple[str, int, int, int]]:
    """Every KV dtype with every (hq, hkv, hd) it can store (q8_0: head_dim a multiple of 32)."""
    return [(dtype, *shape) for dtype in pa.KV_DTYPES for shape in shapes if dtype != "q8_0" or shape[2] % 32 == 0]


@pytest.mark.parametrize("block_size,window", [(1, 0), (3, 5), (5, 7), (16, 0), (16, 9), (6, 30), (32, 0), (32, 21)])
@pytest.mark.parametrize("dtype,hq,hkv,hd", _dtypes_and_shapes([(4, 2, 64), (2, 2, 64), (10, 2, 64), (8, 1, 96), (6, 2, 40)]))
def test_rows_found_across_blocks_and_windows(dtype: str, block_size: int, window: int, hq: int, hkv: int,
                                              hd: int) -> None:
    """The kernel scores whole blocks of 16 keys with vector code (block sizes it divides) and the
    others key by key, and adds value rows 16 dimensions at a time (head dims it divides) or four rows
    at a time: blocks smaller than four rows, sizes neither divides, sliding windows whose first key
    sits anywhere in a block, and groups of 1 to 8 query heads a KV head (a call scores at most 4),
    against the dense reference over the same stored values."""
    n = 37
    n_blocks = -(-n // block_size)
    k_store = pa.KVLayerStore.allocate(dtype, n_blocks + 3, block_size, hkv, hd, keys=True)
    v_store = pa.KVLayerStore.allocate(dtype, n_blocks + 3, block_size, hkv, hd, keys=False)
    tables = rng.permutation(n_blocks + 3)[None, :n_blocks].astype(np.int32)
    k, v = rng.standard_normal((n, hkv, hd)).astype(np.float32), rng.standard_normal((n, hkv, hd)).astype(np.float32)
    pos = np.arange(n)
    k_store.write(tables[0, pos // block_size], pos % block_size, k)
    v_store.write(tables[0, pos // block_size], pos % block_size, v)
    keys = reference_values(dtype, reference_storage(dtype, k)).transpose(1, 0, 2)
    values = reference_values(dtype, reference_storage(dtype, v)).transpose(1, 0, 2)
    positions = np.array([0, 1, 2, 3, 4, 5, 17, 30, 35, 36])  # every row count mod 4, window edges
    q = rng.standard_normal((len(positions), hq, hd)).astype(np.float32)
    got = pa.paged_attention(q, k_store, v_store, tables, np.zeros(len(positions), np.int32), positions, hd**-0.5,
                             window)
    for i, p in enumerate(positions):
        expected = reference.attention(q[i : i + 1], keys, values, int(p), hd**-0.5, window)
        np.testing.assert_allclose(got[i : i + 1], expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype,bound", [("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 1 / 127)])
def test_storage_round_trip_error(dtype: str, bound: float) -> None:
    """Error of rows written to a store and decoded without ember: half an ulp for f16/bf16; for q8_0
    half a step (d = amax/127) plus the f16 rounding of d itself, which each of up to 127 steps
    carries (127 * d * 2^-11)."""
    rows = rng.standard_normal((5, 2, 64)).astype(np.float32)
    store = pa.KVLayerStore.allocate(dtype, 4, 8, 2, 64, keys=True)
    blocks, offsets = write_scattered(store, 4, 8, rows)
    err = np.abs(reference_values(dtype, stored(store, dtype, blocks, offsets)) - rows)
    if dtype == "q8_0":
        amax = np.abs(rows.reshape(5, 2, 2, 32)).max(-1, keepdims=True)
        assert (err.reshape(5, 2, 2, 32) <= amax / 127 * (0.5 + 127 * 2.0**-11) + 1e-7).all()
    else:
        assert (err <= np.abs(rows) * bound / 2 + 1e-30).all()


@njit
def _widened(bits: np.ndarray, bf16: bool) -> np.ndarray:
    """Every value of `bits` as the attention kernel widens a stored value, in a loop that vectorizes
    as the kernel's do."""
    out = np.empty(bits.size, np.float32)
    for j in range(bits.size):
        out[j] = pa._bf16_value(bits[j]) if bf16 else pa._f16_value(bits[j])
    return out


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_stored_values_widened_exactly(dtype: str) -> None:
    """Every 16-bit pattern (and a row's odd tail: 65536 + 5 values) widens to its value, bit for bit
    against numpy's float16 and bf16's layout; NaNs stay NaN (a signaling one may come back quieted,
    as the CPU converts it)."""
    patterns = np.concatenate([np.arange(1 << 16), [0x3C00, 0x7C01, 0x0001, 0x8000, 0xFFFF]]).astype(np.uint16)
    if dtype == "bf16":
        want = (patterns.astype(np.uint32) << 16).view(np.float32)
    else:
        want = patterns.view(np.float16).astype(np.float32)
    got = _widened(patterns, dtype == "bf16")
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_unknown_dtype_bad_head_dim_and_swapped_stores() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype"):
        pa.KVLayerStore.allocate("int4", 1, 16, 1, 64, keys=True)
    with pytest.raises(ValueError, match="head_dim"):
        pa.KVLayerStore.allocate("q8_0", 1, 16, 1, 48, keys=False)
    k, v = (pa.KVLayerStore.allocate("f16", 1, 16, 1, 64, keys=keys) for keys in (True, False))
    q, tables, seq, pos = np.ones((1, 1, 64), np.float32), np.zeros((1, 1), np.int32), np.zeros(1, np.int32), np.zeros(1)
    with pytest.raises(ValueError, match="key store"):
        pa.paged_attention(q, v, k, tables, seq, pos, 0.125)


@pytest.mark.parametrize("dtype,hq,hkv,hd", _dtypes_and_shapes([(4, 2, 64), (2, 2, 64), (10, 2, 64), (6, 2, 40)]))
def test_a_token_gets_the_same_bits_in_any_block_size(dtype: str, hq: int, hkv: int, hd: int) -> None:
    """Engines with different block sizes (a draft model's, a test's) must agree token for token: a
    block of fewer than 16 keys is scored through masked loads, in the same order as a full one, and
    value rows are added row by row whatever the blocks, so the output's bits do not depend on the
    block size (nor on the window's first key sitting anywhere in a block)."""
    n = 45
    k, v = rng.standard_normal((n, hkv, hd)).astype(np.float32), rng.standard_normal((n, hkv, hd)).astype(np.float32)
    positions = np.array([0, 3, 15, 16, 17, 31, 40, 44])
    q = rng.standard_normal((len(positions), hq, hd)).astype(np.float32)
    for window in (0, 11):
        outs = []
        for block_size in (1, 3, 4, 5, 16, 20, 32, 48):
            n_blocks = -(-n // block_size)
            tables = rng.permutation(n_blocks + 2)[None, :n_blocks].astype(np.int32)
            stores = [pa.KVLayerStore.allocate(dtype, n_blocks + 2, block_size, hkv, hd, keys=keys) for keys in (True, False)]
            pos = np.arange(n)
            for store, rows in zip(stores, (k, v)):
                store.write(tables[0, pos // block_size], pos % block_size, rows)
            outs.append(pa.paged_attention(q, *stores, tables, np.zeros(len(positions), np.int32), positions,
                                           hd**-0.5, window))
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0])
