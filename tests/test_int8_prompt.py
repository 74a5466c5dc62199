"""kernels/cpu/int8_prompt.py: prompt rows of quantized weights with int8 activations (prompt_act q8_0).

The activations are quantized as the decode rows' are (ggml's q8_0 against 32-value block types, q8_K
against K-quants: test_quant_matmul.x_hat), so the reference is dequantize(W) @ x_hat in float64, and
the kernel, whose integer sums are exact, may differ from it only by float32 rounding of its per-group
terms; from the decode tiles' result, only by the order those roundings come in.
"""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.cpu import int8_prompt
from ember.kernels.cpu.backend import CpuOps
from ember.kernels.cpu.quant_matmul import CpuWeight, matmul, pack
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference.quant import dequantize, quantize
from ember.kernels.tensor_types import TensorType
from test_quant_matmul import x_hat

TYPES = sorted(int8_prompt.INT8_PROMPT_TYPES)
REL_TOL = 2e-6  # of sum |w x_hat| per output: float32 rounding of ~cols/16 group terms


def weight(ttype: TensorType, rows: int, cols: int, seed: int = 0) -> tuple[CpuWeight, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] = -np.abs(w).max()  # a block whose quants reach the format's extreme
    data = quantize(ttype, w)
    return pack(RawTensor("w", ttype, (rows, cols), data)), dequantize(ttype, data, cols).astype(np.float64)


@pytest.mark.parametrize("ttype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, n", [(1, 1), (21, 17), (37, 40)])
def test_product_equals_the_reference(ttype: TensorType, rows: int, n: int) -> None:
    w, w64 = weight(ttype, rows, 512)
    x = np.random.default_rng(1).standard_normal((n, 512)).astype(np.float32)
    x[0, 64:96] = 0  # a block of zeros: scale 0
    y = matmul(x, w, False, int8_prompts=True)
    xh = x_hat(x, ttype)
    expected, scale = xh @ w64.T, np.abs(xh) @ np.abs(w64).T
    assert y.dtype == np.float32 and y.shape == (n, rows)
    excess = np.abs(y - expected) - REL_TOL * scale
    assert excess.max() <= 0, f"worst excess {excess.max():.3g}"
    # and it is an int8 product, not the float one: x_hat, not x, is what was multiplied
    assert np.abs(y - x.astype(np.float64) @ w64.T).max() > 10 * np.abs(y - expected).max()
    # the decode rows of the same tokens multiply the same x_hat: equal up to float32 rounding
    decode = matmul(x, w, True)
    assert (np.abs(y - decode) - 2 * REL_TOL * scale).max() <= 0


@pytest.mark.parametrize("ttype", [TensorType.Q8_0, TensorType.Q4_K, TensorType.Q6_K], ids=lambda t: t.name)
def test_a_tokens_result_does_not_depend_on_its_call(ttype: TensorType) -> None:
    """The same token alone, in a short call, at any lane of a 16-token vector, in an odd or an even
    vector: the same bits (a prompt's logits must not depend on how its steps were cut)."""
    w, _ = weight(ttype, 70, 768)
    x = np.random.default_rng(2).standard_normal((53, 768)).astype(np.float32)
    whole = matmul(x, w, False, int8_prompts=True)
    for first, count in ((0, 1), (7, 1), (5, 11), (16, 16), (30, 23), (40, 13)):
        part = matmul(x[first:first + count], w, False, int8_prompts=True)
        assert np.array_equal(part, whole[first:first + count]), (first, count)


def test_the_ops_take_prompt_rows_through_it_and_leave_decode_rows_alone() -> None:
    w, _ = weight(TensorType.Q4_K, 48, 512)
    x = np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)
    decode = np.array([False, True, False, False, True, False])
    ops = CpuOps()
    exact = ops.matmul(x, w, decode)
    ops.prompt_act = "q8_0"
    quantized = ops.matmul(x, w, decode)
    assert np.array_equal(quantized[decode], exact[decode])  # decode rows: the decode tiles either way
    assert np.array_equal(quantized[~decode], matmul(x[~decode], w, False, int8_prompts=True))
    assert not np.array_equal(quantized[~decode], exact[~decode])
    gate, _ = weight(TensorType.Q4_K, 48, 512, seed=4)
    fused = ops.swiglu_matmul(x, gate, w, decode)
    parts = ops.swiglu(ops.matmul(x, gate, decode), ops.matmul(x, w, decode))
    assert np.array_equal(fused[~decode], parts[~decode])


def test_float_weights_are_untouched_by_the_policy() -> None:
    w = pack(RawTensor("w", TensorType.F32, (8, 64), np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)))
    x = np.random.default_rng(6).standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(matmul(x, w, False, int8_prompts=True), matmul(x, w, False))


def test_the_policy_defaults_and_refusals() -> None:
    """q8_0 by default where the kernels multiply prompt rows with AVX-512 VNNI or AVX2, f32 elsewhere
    (the portable integer product is slower than the float one); f32 beside decode_act f32 (the exact
    mode computes generated tokens as prompt ones); q8_0 beside decode_act f32 refused rather than
    quietly quantizing the generated tokens."""
    from ember.kernels.convert import DEFAULT_PROMPT_ACT, prompt_act_for
    from ember.kernels.cpu import int8_dots

    assert DEFAULT_PROMPT_ACT == ("q8_0" if int8_dots._VNNI or int8_dots._AVX2 else "f32")
    assert prompt_act_for(None, "q8_0") == DEFAULT_PROMPT_ACT and prompt_act_for("", "q8_0") == DEFAULT_PROMPT_ACT
    assert prompt_act_for("q8_0", "q8_0") == "q8_0"
    assert prompt_act_for(None, "f32") == "f32" and prompt_act_for("f32", "q8_0") == "f32"
    with pytest.raises(ValueError, match="use prompt_act f32 with it"):
        prompt_act_for("q8_0", "f32")
    with pytest.raises(ValueError, match="unknown prompt activation precision 'int4'"):
        prompt_act_for("int4", "q8_0")
