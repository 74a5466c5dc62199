"""Paged KV storage in every dtype and the attention kernel reading it, against numpy references of
the same math and independent decoders of the stored formats (numpy float16, torch bfloat16, gguf-py
q8_0)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from ember.kernels.reference import dense as reference
from ember.kernels.cpu import paged_attention as pa
from ember.kernels.cpu import twin

rng = np.random.default_rng(5)


def decoded(store: pa.KVLayerStore, rows: np.ndarray) -> np.ndarray:
    """What `rows` become once stored, decoded by a library that is not ember."""
    if store.mode == pa.MODE["f32"]:
        return rows
    if store.mode == pa.MODE["f16"]:
        return rows.astype(np.float16).astype(np.float32)
    if store.mode == pa.MODE["bf16"]:
        torch = pytest.importorskip("torch")
        return torch.from_numpy(rows).to(torch.bfloat16).float().numpy()
    q, d = pa.quantize_q8_0_rows(rows)
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), q.reshape(-1, 32).view(np.uint8)], axis=1)
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).reshape(rows.shape)


@pytest.mark.parametrize("dtype", pa.KV_DTYPES)
@pytest.mark.parametrize("parallel", [False, True])
def test_paged_attention_matches_dense_reference(dtype: str, parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(twin, "PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    block_size, hkv, hq, hd, n_blocks = 4, 2, 6, 64, 40
    k_store = pa.KVLayerStore.allocate(dtype, n_blocks, block_size, hkv, hd)
    v_store = pa.KVLayerStore.allocate(dtype, n_blocks, block_size, hkv, hd)
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
        keys.append(decoded(k_store, k))
        values.append(decoded(v_store, v))
    # the step: the last 3 tokens of sequence 3 (a prefill chunk) and the last token of the others
    token_seq = np.array([0, 1, 2, 3, 3, 3], np.int32)
    positions = np.array([0, 6, 12, 27, 28, 29])
    q = rng.standard_normal((6, hq, hd)).astype(np.float32)
    got = pa.paged_attention(q, k_store, v_store, tables, token_seq, positions, hd**-0.5)
    for i, (s, p) in enumerate(zip(token_seq, positions)):
        k, v = keys[s].transpose(1, 0, 2), values[s].transpose(1, 0, 2)  # [hkv, T, hd]
        expected = reference.attention(q[i : i + 1], k, v, int(p), hd**-0.5)
        np.testing.assert_allclose(got[i : i + 1], expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype,bound", [("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 1 / 127)])
def test_storage_round_trip_error(dtype: str, bound: float) -> None:
    """Error of stored rows: half an ulp for f16/bf16; for q8_0 half a step (d = amax/127) plus the
    f16 rounding of d itself, which each of up to 127 steps carries (127 * d * 2^-11)."""
    rows = rng.standard_normal((5, 2, 64)).astype(np.float32)
    store = pa.KVLayerStore.allocate(dtype, 4, 8, 2, 64)
    err = np.abs(decoded(store, rows) - rows)
    if dtype == "q8_0":
        amax = np.abs(rows.reshape(5, 2, 2, 32)).max(-1, keepdims=True)
        assert (err.reshape(5, 2, 2, 32) <= amax / 127 * (0.5 + 127 * 2.0**-11) + 1e-7).all()
    else:
        assert (err <= np.abs(rows) * bound / 2 + 1e-30).all()


def test_unknown_dtype_and_bad_head_dim() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype"):
        pa.KVLayerStore.allocate("int4", 1, 16, 1, 64)
    with pytest.raises(ValueError, match="head_dim"):
        pa.KVLayerStore.allocate("q8_0", 1, 16, 1, 48)
