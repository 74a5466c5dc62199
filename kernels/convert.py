"""The one home of ember's conversions between float32 and its storage dtypes (f16, bf16, q8_0), and of
the dtype lists built on them: STORAGE_DTYPES and KV_DTYPES (the KV cache's choices; everything else
that lists them imports this one tuple). The KV cache
(kernels/cpu/paged_attention.py), the precision policies (daemon/planning/precision.py) and the numpy
reference of the GGML types (kernels/reference/quant.py) all convert through the functions here; each
conversion is bit-exact with ggml:

  f16   f32_to_f16_bits / f16_bits_to_f32: IEEE half, round to nearest even, subnormals kept, beyond
        +-65504 becomes inf — what ggml's GGML_FP32_TO_FP16 computes, and numpy's astype(float16).
        NaN stays NaN with numpy's payload bits (ggml's software path writes 0x7E00, its F16C path
        the quieted payload: no one bit pattern matches both, and every reader sees a NaN).
  bf16  f32_to_bf16_bits / bf16_bits_to_f32: the top half of the float32 bits, rounded to nearest
        even; a NaN becomes the quiet NaN (bits >> 16) | 0x40 — ggml's GGML_FP32_TO_BF16.
  q8_0  quantize_q8_0 / dequantize_q8_0 (and quantize_q8_0_split for stores that keep scales apart):
        ggml's quantize_row_q8_0_ref per block of 32: amax = max |x|, d = amax / 127,
        id = 1 / d (0 when d is 0), q = roundf(x * id) (halves away from zero), d stored as f16.

`encode_rows` / `decode_rows` pick the conversion by dtype name and `storage_bytes` is the size of a
row in storage — the one definition the memory planner uses.

Storage layouts (rows along the last axis, any leading shape):
  f32   float32 [..., n]
  f16   uint16 [..., n], IEEE half bit patterns
  bf16  uint16 [..., n], bfloat16 bit patterns
  q8_0  uint8 [..., ceil(n / 32) * 34], ggml's block_q8_0: the f16 scale d, then 32 int8 values.
        A row whose length is not a multiple of 32 is zero-padded to whole blocks (the padding
        decodes to 0 and is dropped).
Plain numpy: conversions run on rows crossing a boundary (a device split, a feature mirror, a KV
write), never inside a matmul, so they are memory-bound and numpy is as fast as a kernel would be.
"""
from __future__ import annotations

import numpy as np

STORAGE_DTYPES = ("f32", "f16", "bf16", "q8_0")  # every dtype this module stores rows in
KV_DTYPES = STORAGE_DTYPES  # the KV cache can be kept in any of them
# The KV cache's default, as llama.cpp's: half f32's bytes, exact to f16's rounding of each key and
# value, and read faster (decode after a 1536-token prompt on the 100M shape: 1.20x llama.cpp in f16,
# 0.85x in f32; docs/runtime.md). Everything that defaults the KV dtype takes this one.
DEFAULT_KV_DTYPE = "f16"
# Activations that generated tokens' rows meet quantized weights with (StepBatch.decode_rows):
# "q8_0" quantizes them as llama.cpp does, for integer dot products (1.5-2.5x faster CPU decode);
# "f32" computes them exactly like prompt rows.
DECODE_ACTIVATIONS = ("q8_0", "f32")
# Activations that prompt rows meet quantized weights with: "q8_0" quantizes them exactly as decode
# rows are (q8_0 against 32-value block types, q8_K against K-quants) for integer products, as llama.cpp
# computes prompts; "f32" multiplies x itself, exactly. The default is q8_0 where the CPU has AVX-512
# VNNI or AVX2 (docs/runtime.md): prefill 1.6-2x faster with VNNI, the products 1.2-2.3x faster than
# the float ones with AVX2, a prompt token and a generated one meet the weights alike, and its logits
# stay within the llama.cpp oracle's tolerance (transformers' 1e-4 needs f32: tests ask for it).
# Elsewhere f32: the integer product's portable form is 5x slower than the float one, and f32 is exact.
PROMPT_ACTIVATIONS = ("q8_0", "f32")


def _integer_prompts_pay() -> bool:
    """Whether this CPU has what makes integer prompt rows faster than float ones: AVX-512 VNNI or AVX2,
    as kernels/cpu/int8_dots.py finds them (the same LLVM host features; EMBER_INT8_PATH=portable, which
    makes the kernels take the portable path for tests, takes it away). On the 2-core Zen 3 VM (AVX2
    only, 2026-11-30) a 512-token prefill of the demo ran at 945-970 tok/s with q8_0 prompt rows in the
    portable form, 4855-5046 with f32 ones; with AVX2 (int8_prompt.py: unsigned quants meet the
    activations in vpmaddubsw, summed in int16) 512 tokens through 2048 x 768 and 768 x 2048 took
    6.7 / 5.5 ms in Q4_K and 8.9 / 8.6 in Q8_0, against 10.0 / 12.9 with f32 rows."""
    import os

    import llvmlite.binding as llvm  # what numba compiles with: the daemon loads it anyway

    features = llvm.get_host_cpu_features()
    vnni = features.get("avx512vnni", False) and features.get("avx512vl", False)
    return bool(vnni or features.get("avx2", False)) and os.environ.get("EMBER_INT8_PATH") != "portable"


DEFAULT_PROMPT_ACT = "q8_0" if _integer_prompts_pay() else "f32"


def prompt_act_for(prompt_act: str | None, decode_act: str) -> str:
    """The prompt activations a model computes with: `prompt_act` where given, else this machine's
    default (DEFAULT_PROMPT_ACT), or f32 beside decode_act f32. decode_act f32 computes generated
    tokens as prompt tokens, so it is exact only with f32 prompt rows: q8_0 beside it is refused,
    not quietly quantized."""
    if prompt_act is None or prompt_act == "":
        return "f32" if decode_act == "f32" else DEFAULT_PROMPT_ACT
    if prompt_act not in PROMPT_ACTIVATIONS:
        raise ValueError(f"unknown prompt activation precision {prompt_act!r} (choose from {', '.join(PROMPT_ACTIVATIONS)})")
    if decode_act == "f32" and prompt_act != "f32":
        raise ValueError(f"decode_act f32 computes generated tokens exactly, as prompt tokens; prompt_act {prompt_act} "
                         "would quantize them: use prompt_act f32 with it (or decode_act q8_0)")
    return prompt_act
QK8_0 = 32  # values per q8_0 block
QK_K_ACT = 256  # values per block of the integer kernels' activations against K-quant weights (q8_K)
Q8_0_BLOCK_BYTES = 2 + QK8_0  # f16 scale + 32 int8

_BF16_QUIET = np.uint32(0x0040)  # the quiet bit of a bfloat16 NaN's mantissa


def storage_bytes(dtype: str, n: int) -> int:
    """Bytes of one row of `n` values stored as `dtype` (q8_0: whole blocks of 34 bytes)."""
    if dtype == "f32":
        return 4 * n
    if dtype in ("f16", "bf16"):
        return 2 * n
    if dtype == "q8_0":
        return -(-n // QK8_0) * Q8_0_BLOCK_BYTES
    raise _unknown(dtype)


def encode_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rows [..., n] -> storage of `dtype` (layouts in the module docstring)."""
    x = np.ascontiguousarray(x, np.float32)
    if dtype == "f32":
        return x.copy()
    if dtype == "f16":
        return f32_to_f16_bits(x)
    if dtype == "bf16":
        return f32_to_bf16_bits(x)
    if dtype == "q8_0":
        return quantize_q8_0(x)
    raise _unknown(dtype)


def decode_rows(data: np.ndarray, dtype: str, n: int) -> np.ndarray:
    """Storage of `dtype` -> float32 rows [..., n]; `n` is needed because q8_0 rows are padded."""
    if dtype == "f32":
        return np.ascontiguousarray(data, np.float32).copy()
    if dtype == "f16":
        return f16_bits_to_f32(data)
    if dtype == "bf16":
        return bf16_bits_to_f32(data)
    if dtype == "q8_0":
        return dequantize_q8_0(data, n)
    raise _unknown(dtype)


def _unknown(dtype: str) -> ValueError:
    return ValueError(f"unknown storage dtype {dtype!r} (choose from {', '.join(STORAGE_DTYPES)})")


# --- 16-bit floats ------------------------------------------------------------------------------
def f32_to_f16_bits(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 [...] IEEE half bits, round to nearest even (ggml's GGML_FP32_TO_FP16)."""
    with np.errstate(over="ignore"):  # out of range becomes inf, as in ggml and on the device
        return np.asarray(x, np.float32).astype(np.float16).view(np.uint16)


def f16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 [...] IEEE half bits -> float32 [...] (exact: every half is a float32)."""
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 [...] -> uint16 [...] bfloat16 bits, as ggml_compute_fp32_to_bf16: round to nearest
    even; a NaN keeps its top bits with the quiet bit set (the rounding alone would carry a NaN whose
    payload sits in the low half into infinity)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    # No wraparound: the largest non-NaN pattern (-inf, 0xFF800000) plus 0x8000 still fits in 32 bits.
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, (u >> np.uint32(16)) | _BF16_QUIET, rounded).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 [...] bfloat16 bits -> float32 [...] (exact: the bits are the top half of a float32)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


# --- q8_0 ---------------------------------------------------------------------------------------
def quantize_q8_0_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., n], n a multiple of 32 -> (scales uint16 [..., n/32] f16 bits, quants int8
    [..., n]): ggml's quantize_row_q8_0_ref, block by block along the last axis, with the scales
    apart from the values (the KV cache keeps them in separate arrays; quantize_q8_0 interleaves).

    Inputs ggml leaves undefined get gguf-py's answer, made explicit: a NaN in a block makes its
    scale NaN (ggml's MAX macro keeps or drops a NaN depending on where it sits), and a value whose
    x * id is not finite (inf or NaN in the block, or a block so small that 1 / d overflows) is
    stored as 0, which is what C's and numpy's float -> int8 casts give on x86.
    """
    d, q = _symmetric_blocks(x, QK8_0, "q8_0")
    return f32_to_f16_bits(d), q


def quantize_q8_k_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., n], n a multiple of 256 -> (scales float32 [..., n/256], quants int8 [..., n]):
    the activation format ember's integer kernels use against K-quant weights, after ggml's q8_K
    (one float32 scale per 256 values, so a super-block's sub-block products add up in integers).
    The rule is q8_0's (d = max|x| / 127, q = roundf(x / d)), kept as a float32 scale; ggml's own
    q8_K takes its scale from the signed extreme (-127 / max), which ember does not copy."""
    return _symmetric_blocks(x, QK_K_ACT, "q8_K")


def quantize_q8_1_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., n], n a multiple of 32 -> (scales float32 [..., n/32], quants int8 [..., n]): the
    activation format of the native GPU GEMVs, ggml's q8_1 with its scale kept as float32 (the quants are
    q8_0's, by the same rule; the kernels add each block's sum of quants beside the scale)."""
    return _symmetric_blocks(x, QK8_0, "q8_1")


def _symmetric_blocks(x: np.ndarray, block: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(d float32 [..., n/block], q int8 [..., n]) with d = max|x| / 127 and q = roundf(x * (1/d)) per
    block (the rules of the docstring above for undefined inputs)."""
    x = np.ascontiguousarray(x, np.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    if n % block:
        raise ValueError(f"{name} rows need a multiple of {block} values, got {n}")
    blocks = x.reshape(-1, block)
    # The warnings would only report the hostile inputs the docstring defines an answer for.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        scaled = blocks * inv
        q = np.where(np.isfinite(scaled), _round_half_away(scaled), np.float32(0)).astype(np.int8)
    return d.reshape(lead + (n // block,)), q.reshape(x.shape)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 [..., n] -> uint8 [..., ceil(n/32) * 34] in ggml's block_q8_0 layout, bit-exact with
    ggml's quantize_row_q8_0_ref and gguf-py's Q8_0; a partial last block is padded with zeros."""
    x = np.ascontiguousarray(x, np.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    nb = -(-n // QK8_0)
    padded = np.zeros(lead + (nb * QK8_0,), np.float32)
    padded[..., :n] = x
    scales, quants = quantize_q8_0_split(padded)
    out = np.empty((scales.size, Q8_0_BLOCK_BYTES), np.uint8)
    out[:, :2] = scales.reshape(-1, 1).view(np.uint8)
    out[:, 2:] = quants.reshape(-1, QK8_0).view(np.uint8)
    return out.reshape(lead + (nb * Q8_0_BLOCK_BYTES,))


def dequantize_q8_0(data: np.ndarray, n: int) -> np.ndarray:
    """uint8 [..., ceil(n/32) * 34] block_q8_0 rows -> float32 [..., n]: x = q * d, in float32 as
    ggml's dequantize_row_q8_0."""
    data = np.ascontiguousarray(data, np.uint8)
    nb = -(-n // QK8_0)
    if data.shape[-1] != nb * Q8_0_BLOCK_BYTES:
        raise ValueError(f"q8_0 rows of {n} values take {nb * Q8_0_BLOCK_BYTES} bytes, got {data.shape[-1]}")
    lead = data.shape[:-1]
    blocks = data.reshape(-1, Q8_0_BLOCK_BYTES)
    d = f16_bits_to_f32(blocks[:, :2].copy().view(np.uint16))
    values = blocks[:, 2:].view(np.int8).astype(np.float32) * d
    return values.reshape(lead + (nb * QK8_0,))[..., :n].copy()


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf, as ggml's reference quantizer uses (np.rint would round half to even). Exact:
    a - floor(a) and its double are exact in float32."""
    a = np.abs(v)
    floored = np.floor(a)
    return np.sign(v) * (floored + np.floor(2 * (a - floored)))
