"""Numpy reference of every storage type ember reads: dequantize (the oracle) and quantize (for tests).

This module owns the byte layouts of ggml's blocks as ember understands them. Everything here is plain,
vectorised numpy, written for clarity and for being checked against gguf-py, never for decode speed
(the hot kernels live in kernels/cpu/quant_matmul.py).

Storage convention (that of RawTensor.data, flattened to 2-D):
  F32: float32 [rows, cols];  F16 / BF16: uint16 [rows, cols] raw bits;
  Q8_0 / Q4_K / Q5_K / Q6_K: uint8 [rows, row_bytes], each row a run of ggml blocks.

Block layouts (ggml-common.h; all little-endian, f16 = IEEE half):
  block_q8_0 (32 values, 34 B):  d f16 | qs int8[32]                       x = d*q
  block_q4_K (256 values, 144 B): d f16 | dmin f16 | scales u8[12] | qs u8[128]
      8 sub-blocks of 32, each with a 6-bit scale and 6-bit min packed in `scales` (get_scale_min_k4);
      qs byte 32*g + l holds value 64*g + l (low nibble) and 64*g + 32 + l (high nibble).
      x = d*sc[j]*q - dmin*m[j]
  block_q5_K (256 values, 176 B): d f16 | dmin f16 | scales u8[12] | qh u8[32] | qs u8[128]
      as q4_K, plus a 5th bit: bit j of qh[l] belongs to value 32*j + l (sub-block j).
  block_q6_K (256 values, 210 B): ql u8[128] | qh u8[64] | scales int8[16] | d f16
      two halves of 128; in half h, for l < 32, with ql = ql[64h:], qh = qh[32h:]:
      value 128h + 32k + l has low 4 bits from ql[l + 32*(k&1)] (nibble k>>1), high 2 bits from
      qh[l] >> 2k, scale scales[8h + l//16 + 2k]; x = d*scale*(q - 32).

F16, BF16 and Q8_0 convert through kernels/convert.py, ember's one implementation of those
conversions (bit-exact with ggml); so do every f16 field of a block. The K-quant quantizers port
llama.cpp's reference ones (quantize_row_*_ref with make_qkx2_quants and make_qx_quants), vectorised
over all blocks at once instead of looping per block. They are not bit-exact with llama.cpp (numpy
sums pairwise, C sums in order), but they produce valid blocks with the same error statistics.
"""
from __future__ import annotations

import numpy as np

from ember.kernels.convert import (QK8_0, bf16_bits_to_f32, dequantize_q8_0, f16_bits_to_f32, f32_to_bf16_bits,
                                   f32_to_f16_bits, quantize_q8_0)
from ember.kernels.tensor_types import BLOCK_GEOMETRY, QK_K, TensorType

GROUP_MAX_EPS = np.float32(1e-15)  # ggml: below this a group counts as all-zero
# Quantize this many values at a time so temporaries stay cache-sized and memory stays bounded.
_CHUNK_VALUES = 1 << 20

__all__ = ["dequantize", "quantize"]


# --------------------------------------------------------------------------------------------------
# dequantize
# --------------------------------------------------------------------------------------------------
def dequantize(ttype: TensorType, data: np.ndarray, cols: int) -> np.ndarray:
    """float32 [rows, cols] from storage `data` (see the module docstring for its convention)."""
    ttype = TensorType(ttype)
    if ttype == TensorType.F32:
        return np.asarray(data, np.float32).reshape(-1, cols).copy()
    if ttype == TensorType.F16:
        return f16_bits_to_f32(np.asarray(data).view(np.uint16).reshape(-1, cols))
    if ttype == TensorType.BF16:
        return bf16_bits_to_f32(np.asarray(data).view(np.uint16).reshape(-1, cols))
    blocks = np.asarray(data, np.uint8).reshape(-1, BLOCK_GEOMETRY[ttype][1])
    values = _DEQUANTIZE_BLOCKS[ttype](blocks)
    return values.reshape(-1, cols)


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 from little-endian f16 bytes: uint8 [..., 2] -> [..., 1]."""
    return f16_bits_to_f32(np.ascontiguousarray(raw).view(np.uint16))


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    return dequantize_q8_0(blocks, QK8_0)


def unpack_scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml get_scale_min_k4 for all 8 sub-blocks: uint8 [n, 12] -> (sc, m), each uint8 [n, 8]."""
    s = scales.astype(np.uint8)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, m


def pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of unpack_scale_min_k4: 6-bit sc, m uint8 [n, 8] -> uint8 [n, 12]."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block multipliers of a q4_K/q5_K block: (d*sc, dmin*m), float32 [n, 8, 1]."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = unpack_scale_min_k4(blocks[:, 4:16])
    # Same operation order as ggml (and gguf-py): the products first, then q*(d*sc) - dmin*m.
    return (d * sc.astype(np.float32))[:, :, None], (dmin * m.astype(np.float32))[:, :, None]


def _nibbles_q4_k(qs: np.ndarray) -> np.ndarray:
    """uint8 [n, 128] -> 4-bit values uint8 [n, 8, 32] in sub-block order."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, 8, 32)


def _dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    dsc, dm = _k_scales(blocks)
    q = _nibbles_q4_k(blocks[:, 16:144]).astype(np.float32)
    return (dsc * q - dm).reshape(-1, QK_K)


def _dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    dsc, dm = _k_scales(blocks)
    qh = blocks[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, 8, 32]
    q = (_nibbles_q4_k(blocks[:, 48:176]) | (high << 4)).astype(np.float32)
    return (dsc * q - dm).reshape(-1, QK_K)


def _dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 15).reshape(n, 2, 4, 32)  # [half, k, l]: k = 0,1 low nibbles, 2,3 high nibbles
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = qh & 3  # [half, k, l]
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16], one per 16 values
    d = _f16(blocks[:, 208:210])
    dsc = (d * scales)[:, :, None]
    return (dsc * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


_DEQUANTIZE_BLOCKS = {
    TensorType.Q8_0: _dequantize_q8_0,
    TensorType.Q4_K: _dequantize_q4_k,
    TensorType.Q5_K: _dequantize_q5_k,
    TensorType.Q6_K: _dequantize_q6_k,
}


# --------------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------------
def quantize(ttype: TensorType, w: np.ndarray) -> np.ndarray:
    """Storage array for float32 weights w [rows, cols], in the module's storage convention."""
    ttype = TensorType(ttype)
    w = np.asarray(w, np.float32)
    if w.ndim == 1:
        w = w[None, :]
    rows, cols = w.shape
    if ttype == TensorType.F32:
        return w.copy()
    if ttype == TensorType.F16:
        return f32_to_f16_bits(w)
    if ttype == TensorType.BF16:
        return f32_to_bf16_bits(w)
    block_values, block_bytes = BLOCK_GEOMETRY[ttype]
    if cols % block_values:
        raise ValueError(f"{ttype.name}: {cols} columns is not a multiple of {block_values}")
    x = np.ascontiguousarray(w).reshape(-1, block_values)
    out = np.empty((x.shape[0], block_bytes), np.uint8)
    step = max(1, _CHUNK_VALUES // block_values)
    for start in range(0, x.shape[0], step):
        out[start:start + step] = _QUANTIZE_BLOCKS[ttype](x[start:start + step])
    return out.reshape(rows, -1)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml nearest_int: round half to even, in float32 (the `+ 12582912.f` trick does the same)."""
    return np.rint(v)


def _make_qkx2_scales(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                      nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qkx2_quants (use_mad=false) for every group at once: x, weights [..., n].

    Returns (scale, the_min) per group, with x ~= scale*L - the_min, L in 0..nmax. Searches nstep+1
    trial inverse scales around nmax/(max-min) and keeps the weighted-least-squares (scale, min) fit
    with the smallest weighted squared error. The quantized levels themselves are recomputed by the
    caller after the scales are rounded to 6 bits, as llama.cpp does.
    """
    f32 = np.float32
    xmin = np.minimum(x.min(axis=-1), f32(0))
    xmax = x.max(axis=-1)
    sum_w = weights.sum(axis=-1)
    sum_x = (weights * x).sum(axis=-1)
    flat = xmax == xmin

    def levels(iscale: np.ndarray, vmin: np.ndarray) -> np.ndarray:
        return np.clip(_nearest_int(iscale[..., None] * (x - vmin[..., None])), 0, nmax)

    def span(vmin: np.ndarray) -> np.ndarray:
        return np.where(flat, f32(1), xmax - vmin)

    iscale = f32(nmax) / span(xmin)
    scale = f32(1) / iscale
    best_min = xmin.copy()
    diff = scale[..., None] * levels(iscale, xmin) + xmin[..., None] - x
    best_err = (weights * diff * diff).sum(axis=-1)
    for step in range(nstep + 1):
        # As in ggml, each trial is centred on the best (scale, min) found so far, not the initial one.
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / span(best_min)
        lv = levels(iscale, best_min)
        wl = weights * lv
        sum_l = wl.sum(axis=-1)
        sum_l2 = (wl * lv).sum(axis=-1)
        sum_xl = (wl * x).sum(axis=-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive_min = this_min > 0  # a positive offset is not representable: refit the scale alone
        this_scale = np.where(positive_min, sum_xl / np.where(sum_l2 > 0, sum_l2, f32(1)), this_scale)
        this_min = np.where(positive_min, f32(0), this_min)
        diff = this_scale[..., None] * lv + this_min[..., None] - x
        err = (weights * diff * diff).sum(axis=-1)
        better = ok & (err < best_err)
        best_err = np.where(better, err, best_err)
        scale = np.where(better, this_scale, scale)
        best_min = np.where(better, this_min, best_min)
    scale = np.where(flat, f32(0), scale).astype(f32)
    return scale, (-best_min).astype(f32)


def _scale_code(values: np.ndarray, vmax: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Code per-group values as vmax/levels * code with code in 0..levels; -> (code, f16 bits of the step)."""
    f32 = np.float32
    inv = np.where(vmax > 0, f32(levels) / np.where(vmax > 0, vmax, f32(1)), f32(0))
    code = np.clip(_nearest_int(inv[:, None] * values), 0, levels).astype(np.uint8)
    return code, f32_to_f16_bits(vmax / f32(levels))


def _quantize_k_sub_blocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Shared part of q4_K / q5_K: x [n, 256] -> (d, dmin f16 bytes, scales [n,12], L [n, 8, 32])."""
    f32 = np.float32
    xs = x.reshape(-1, 8, 32)
    av_x = np.sqrt((xs * xs).sum(axis=-1) / f32(32))
    weights = av_x[..., None] + np.abs(xs)
    scales, mins = _make_qkx2_scales(xs, weights, nmax, rmin, rdelta, nstep)
    # ggml starts both maxima at 0: a super-block whose scales are all <= 0 codes them all as 0.
    sc, d16 = _scale_code(scales, np.maximum(scales.max(axis=1), f32(0)), 63)
    m, dmin16 = _scale_code(mins, np.maximum(mins.max(axis=1), f32(0)), 63)
    # Requantize against the rounded (6-bit, f16) scales that the decoder will actually use.
    d = f16_bits_to_f32(d16)[:, None] * sc.astype(f32)
    dm = f16_bits_to_f32(dmin16)[:, None] * m.astype(f32)
    live = d > 0
    safe_d = np.where(live, d, f32(1))
    lv = np.clip(_nearest_int((xs + dm[..., None]) / safe_d[..., None]), 0, nmax)
    lv = np.where(live[..., None], lv, 0).astype(np.uint8)
    head = np.concatenate([d16.reshape(-1, 1).view(np.uint8), dmin16.reshape(-1, 1).view(np.uint8),
                           pack_scale_min_k4(sc, m)], axis=1)
    return head, lv


def _pack_nibbles_q4_k(lv: np.ndarray) -> np.ndarray:
    """4-bit levels [n, 8, 32] -> qs uint8 [n, 128] (sub-blocks 2g, 2g+1 share bytes 32g..32g+31)."""
    pairs = (lv & 15).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(-1, 128)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_K_ref over super-blocks x [n, 256]."""
    head, lv = _quantize_k_sub_blocks(x, nmax=15, rmin=-1.0, rdelta=0.1, nstep=20)
    return np.concatenate([head, _pack_nibbles_q4_k(lv)], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q5_K_ref over super-blocks x [n, 256]."""
    head, lv = _quantize_k_sub_blocks(x, nmax=31, rmin=-0.5, rdelta=0.1, nstep=15)
    bit = ((lv >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(bit, axis=1)  # [n, 32]: bit j of qh[l] is the 5th bit of value 32j + l
    return np.concatenate([head, qh, _pack_nibbles_q4_k(lv)], axis=1)


def _make_qx_scales(x: np.ndarray, nmax: int) -> np.ndarray:
    """make_qx_quants(rmse_type=1, no importance weights) for every group: x [..., n] -> scale.

    Signed symmetric levels in -nmax..nmax-1, weights x^2; tries 19 inverse scales around -nmax/max
    and keeps the one maximising sumlx^2/suml2 (least-squares optimal scale per level choice).
    """
    f32 = np.float32
    absx = np.abs(x)
    idx = absx.argmax(axis=-1)[..., None]  # first largest |x|, as the C loop's strict `>`
    amax = np.take_along_axis(absx, idx, axis=-1)[..., 0]
    signed_max = np.take_along_axis(x, idx, axis=-1)[..., 0]
    zero = amax < GROUP_MAX_EPS
    signed_max = np.where(zero, f32(1), signed_max)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lv = np.clip(_nearest_int(iscale[..., None] * x), -nmax, nmax - 1)
        wl = w * lv
        return (wl * x).sum(axis=-1), (wl * lv).sum(axis=-1)

    sumlx, suml2 = fit(f32(-nmax) / signed_max)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f32(1)), f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = fit(-(f32(nmax) + f32(0.1) * f32(step)) / signed_max)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        new_scale = sumlx / np.where(suml2 > 0, suml2, f32(1))
        scale = np.where(better, new_scale, scale)
        best = np.where(better, new_scale * sumlx, best)
    return np.where(zero, f32(0), scale).astype(f32)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref over super-blocks x [n, 256]."""
    f32 = np.float32
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    scales = _make_qx_scales(xs, 32)  # [n, 16]
    idx = np.abs(scales).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, idx, axis=1)[:, 0]
    live_block = np.abs(max_scale) >= GROUP_MAX_EPS
    iscale = f32(-128) / np.where(live_block, max_scale, f32(1))
    d16 = f32_to_f16_bits(np.where(live_block, f32(1) / iscale, f32(0)))
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales))
    sc = np.where(live_block[:, None], sc, 0).astype(np.int8)
    # Requantize against the rounded scales the decoder will use.
    d = f16_bits_to_f32(d16)[:, None] * sc.astype(f32)
    live = d != 0
    lv = np.clip(_nearest_int(xs / np.where(live, d, f32(1))[..., None]), -32, 31) + 32
    lv = np.where(live[..., None], lv, 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, k, l]
    ql = np.concatenate([(lv[:, :, 0] & 15) | ((lv[:, :, 2] & 15) << 4),
                         (lv[:, :, 1] & 15) | ((lv[:, :, 3] & 15) << 4)], axis=2)  # [n, 2, 64]
    qh = ((lv[:, :, 0] >> 4) | ((lv[:, :, 1] >> 4) << 2) | ((lv[:, :, 2] >> 4) << 4)
          | ((lv[:, :, 3] >> 4) << 6))  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           d16.reshape(-1, 1).view(np.uint8)], axis=1)


_QUANTIZE_BLOCKS = {
    TensorType.Q8_0: quantize_q8_0,  # blocks [n, 32] -> [n, 34]
    TensorType.Q4_K: _quantize_q4_k,
    TensorType.Q5_K: _quantize_q5_k,
    TensorType.Q6_K: _quantize_q6_k,
}
