"""The native kernels' weight layout (kernels/cuda/repack.py) holds the file's bits: its dequantization
equals gguf-py's of the original blocks bit for bit, for every type, in the same number of bytes. Pure
numpy: this runs in the fast tier, GPU or not."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from ember.kernels.cuda import repack
from ember.kernels.tensor_types import TensorType
from tests.cuda.native_data import random_weight

NEEDS_DEVICE = False  # conftest.py: numpy only


@pytest.mark.parametrize("ttype", repack.NATIVE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(1, 256), (5, 768), (3, 2048)])
def test_repacked_weights_dequantize_as_gguf_does_bit_for_bit(ttype: TensorType, rows: int, cols: int) -> None:
    data = random_weight(ttype, rows, cols, np.random.default_rng(rows * cols + int(ttype)))
    w = repack.repack(ttype, data, rows, cols)
    theirs = gguf_dequantize(np.ascontiguousarray(data).view(np.uint8), gguf.GGMLQuantizationType(int(ttype)))
    ours = repack.dequantize(w)
    assert ours.shape == (rows, cols)
    assert np.array_equal(ours.view(np.uint32), theirs.reshape(rows, cols).astype(np.float32).view(np.uint32))
    assert w.nbytes == data.nbytes  # nothing added: the same bits, moved
    assert all(a.flags.c_contiguous for a in w.arrays)


def test_each_unit_of_a_k_quant_is_one_run_of_16_bytes_in_value_order() -> None:
    # sub-block j of ggml's Q4_K shares its bytes with sub-block j ^ 1; repacked, unit u holds values
    # 32u..32u+31 alone: low nibbles 0-15, high nibbles 16-31
    data = random_weight(TensorType.Q4_K, 1, 256, np.random.default_rng(3))
    w = repack.repack(TensorType.Q4_K, data, 1, 256)
    nibbles = np.concatenate([w.q.reshape(8, 16) & 15, w.q.reshape(8, 16) >> 4], axis=1)  # [unit, value]
    head = data[0, :144]
    qs = head[16:]
    expected = np.stack([(qs[32 * (j // 2):32 * (j // 2) + 32] >> (4 * (j % 2))) & 15 for j in range(8)])
    assert np.array_equal(nibbles, expected)
    assert np.array_equal(w.sc.reshape(-1), head[:16])


@pytest.mark.parametrize("ttype,cols", [(TensorType.F32, 64), (TensorType.Q4_K, 96), (TensorType.Q8_0, 48)])
def test_what_has_no_native_layout_is_refused(ttype: TensorType, cols: int) -> None:
    with pytest.raises(ValueError, match="native"):
        repack.repack(ttype, np.zeros((1, cols * 4), np.uint8), 1, cols)
