"""Numpy reference of every storage type ember reads: dequantize (the oracle) and quantize (for tests).

This module owns the byte layouts of ggml's blocks as ember understands them. Everything here is plain,
vectorised numpy, written for clarity and for being checked against gguf-py, never for decode speed
(the hot kernels live in kernels/cpu/quant_matmul.py).

Storage convention (that of RawTensor.data, flattened to 2-D):
  F32: float32 [rows, cols];  F16 / BF16: uint16 [rows, cols] raw bits;
  every block type: uint8 [rows, row_bytes], each row a run of ggml blocks.

Block layouts (ggml-common.h; all little-endian, f16 = IEEE half):
  block_q8_0 (32 values, 34 B):  d f16 | qs int8[32]                       x = d*q
  block_q4_0 (32 values, 18 B):  d f16 | qs u8[16]; byte l holds value l (low nibble) and l + 16
      (high nibble)                                                        x = d*(q - 8)
  block_q4_1 (32 values, 20 B):  d f16 | m f16 | qs u8[16] as q4_0         x = d*q + m
  block_q5_0 (32 values, 22 B):  d f16 | qh u32 | qs u8[16] as q4_0; bit l of qh is bit 4 of value l
                                                                           x = d*(q - 16)
  block_q5_1 (32 values, 24 B):  d f16 | m f16 | qh u32 | qs u8[16] as q5_0   x = d*q + m
  block_iq4_nl (32 values, 18 B): d f16 | qs u8[16] as q4_0; a code c stands for IQ4_LEVELS[c]
                                                                           x = d*IQ4_LEVELS[q]
  block_q2_K (256 values, 84 B): scales u8[16] | qs u8[64] | d f16 | dmin f16
      value 128h + 32j + l (l < 32) is (qs[32h + l] >> 2j) & 3; its 16-value group g = (value)/16 has
      scale scales[g] & 15 and min scales[g] >> 4.                         x = d*sc*q - dmin*m
  block_q3_K (256 values, 110 B): hmask u8[32] | qs u8[64] | scales u8[12] | d f16
      low 2 bits as q2_K's; bit 2 is bit (value / 32) of hmask[value % 32]; q = that 3-bit u - 4;
      sixteen 6-bit scales, s - 32 (group g: low 4 bits in nibble g // 8 of scales[g % 8], high 2 bits
      at bits 2(g // 4) of scales[8 + g % 4]).                             x = d*(s - 32)*q
  block_iq4_xs (256 values, 136 B): d f16 | scales_h u16 | scales_l u8[4] | qs u8[128]
      8 sub-blocks of 32, each laid out as iq4_nl's qs (bytes 16j..16j+15); sub-block j's 6-bit scale
      s = nibble j % 2 of scales_l[j // 2] | ((scales_h >> 2j) & 3) << 4.  x = d*(s - 32)*IQ4_LEVELS[q]
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
conversions (bit-exact with ggml); so do every f16 field of a block. Q4_0, Q4_1, Q5_0 and Q5_1 are
quantized as ggml's quantize_row_*_ref, bit for bit. The K-quant quantizers port llama.cpp's reference
ones (quantize_row_*_ref with make_qkx2_quants and make_qx_quants), vectorised over all blocks at once
instead of looping per block. They are not bit-exact with llama.cpp (numpy sums pairwise, C sums in
order; Q3_K's scales are searched with make_qx_quants where llama.cpp uses make_q3_quants, and the
IQ4 ones search the scale as make_qx_quants does, over the table's levels), but they produce valid
blocks with error statistics close to llama.cpp's. They exist for tests; files quantized by llama.cpp
itself are what the oracle tests read.
"""
from __future__ import annotations

import numpy as np

from ember.kernels.convert import (QK8_0, bf16_bits_to_f32, dequantize_q8_0, f16_bits_to_f32, f32_to_bf16_bits,
                                   f32_to_f16_bits, quantize_q8_0)
from ember.kernels.tensor_types import BLOCK_GEOMETRY, IQ4_LEVELS, QK_K, TensorType

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


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] -> 4-bit codes uint8 [..., 32]: low nibbles (values 0-15), then high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """uint8 [n, 4] (a little-endian u32) -> bit l of it at value l, as uint8 [n, 32] of 0 / 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return bits << 4


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
    return _f16(blocks[:, 0:2]) * q.astype(np.float32)


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    return _f16(blocks[:, 0:2]) * q + _f16(blocks[:, 2:4])


def _dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 6:22]) | _fifth_bits(blocks[:, 2:6])).astype(np.int8) - np.int8(16)
    return _f16(blocks[:, 0:2]) * q.astype(np.float32)


def _dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    q = (_nibbles(blocks[:, 8:24]) | _fifth_bits(blocks[:, 4:8])).astype(np.float32)
    return _f16(blocks[:, 0:2]) * q + _f16(blocks[:, 2:4])


_IQ4_LEVELS = np.array(IQ4_LEVELS, np.int8)


def _dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks[:, 0:2]) * _IQ4_LEVELS[_nibbles(blocks[:, 2:18])].astype(np.float32)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's low 2 bits: qs uint8 [n, 64] -> uint8 [n, 256] in value order."""
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, QK_K)


def _dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    scales = blocks[:, 0:16]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 15).astype(np.float32))[:, :, None]
    ml = (dmin * (scales >> 4).astype(np.float32))[:, :, None]
    q = _crumbs(blocks[:, 16:80]).reshape(-1, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(-1, QK_K)


def unpack_q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes uint8 [n, 12] -> the sixteen signed scales s - 32, int8 [n, 16]."""
    low = np.concatenate([scales[:, 0:8] & 15, scales[:, 0:8] >> 4], axis=1)
    high = (scales[:, 8:12][:, None, :] >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3
    return (low | (high.reshape(-1, 16) << 4)).astype(np.int8) - np.int8(32)


def _dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    hmask = blocks[:, 0:32]
    high = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, 8, 32]
    q = (_crumbs(blocks[:, 32:96]) | (high.reshape(-1, QK_K) << 2)).astype(np.int8) - np.int8(4)
    dl = (_f16(blocks[:, 108:110]) * unpack_q3_k_scales(blocks[:, 96:108]).astype(np.float32))[:, :, None]
    return (dl * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


def unpack_iq4_xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks uint8 [n, 136] -> the eight signed sub-block scales s - 32, int8 [n, 8]."""
    high = blocks[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)
    low = (blocks[:, 4:8][:, :, None] >> np.array([0, 4], np.uint8)).reshape(-1, 8) & 15
    return (low | ((high & 3).astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)


def _dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    dl = (_f16(blocks[:, 0:2]) * unpack_iq4_xs_scales(blocks).astype(np.float32))[:, :, None]
    q = _IQ4_LEVELS[_nibbles(blocks[:, 8:136].reshape(-1, 8, 16))].astype(np.float32)
    return (dl * q).reshape(-1, QK_K)


_DEQUANTIZE_BLOCKS = {
    TensorType.Q4_0: _dequantize_q4_0,
    TensorType.Q4_1: _dequantize_q4_1,
    TensorType.Q5_0: _dequantize_q5_0,
    TensorType.Q5_1: _dequantize_q5_1,
    TensorType.IQ4_NL: _dequantize_iq4_nl,
    TensorType.Q2_K: _dequantize_q2_k,
    TensorType.Q3_K: _dequantize_q3_k,
    TensorType.IQ4_XS: _dequantize_iq4_xs,
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
    signed_max = _signed_max(x)
    amax = np.abs(signed_max)
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
    max_scale = _signed_max(scales)
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


def _signed_max(x: np.ndarray) -> np.ndarray:
    """Per group along x's last axis: the value of largest magnitude, sign kept (the first such, as
    ggml's loops with a strict comparison)."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _truncate(v: np.ndarray) -> np.ndarray:
    """C's (int8_t) cast of a float32: toward zero (a block whose 1 / d overflowed casts infinities, as
    gguf-py's quantizer does; ggml's gives the same bytes)."""
    with np.errstate(invalid="ignore"):
        return np.trunc(v).astype(np.int32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, 0 where d is 0 (and inf where d is too small for float32, as in ggml)."""
    with np.errstate(over="ignore"):
        return np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """4-bit codes uint8 [n, 32] -> qs uint8 [n, 16] (value l low, value l + 16 high)."""
    return (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)


def _pack_fifth_bits(q: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 codes uint8 [n, 32] -> qh as 4 little-endian bytes [n, 4]."""
    return np.packbits((q >> 4) & 1, axis=1, bitorder="little")


def _symmetric_codes(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q4_0_ref / q5_0_ref: d = max / -levels, codes (x / d + levels + 0.5) truncated."""
    d = _signed_max(x) / np.float32(-levels)
    codes = np.minimum(2 * levels - 1, _truncate(x * _inverse(d)[:, None] + np.float32(levels + 0.5)))
    return codes.astype(np.uint8), f32_to_f16_bits(d).reshape(-1, 1).view(np.uint8)


def _offset_codes(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q4_1_ref / q5_1_ref: d = (max - min) / levels, codes ((x - min) / d + 0.5) truncated."""
    low, high = x.min(axis=1), x.max(axis=1)
    d = (high - low) / np.float32(levels)
    codes = np.minimum(levels, _truncate((x - low[:, None]) * _inverse(d)[:, None] + np.float32(0.5)))
    head = np.concatenate([f32_to_f16_bits(d).reshape(-1, 1).view(np.uint8),
                           f32_to_f16_bits(low).reshape(-1, 1).view(np.uint8)], axis=1)
    return codes.astype(np.uint8), head


def _quantize_q4_0(x: np.ndarray) -> np.ndarray:
    codes, head = _symmetric_codes(x, 8)
    return np.concatenate([head, _pack_nibbles(codes)], axis=1)


def _quantize_q4_1(x: np.ndarray) -> np.ndarray:
    codes, head = _offset_codes(x, 15)
    return np.concatenate([head, _pack_nibbles(codes)], axis=1)


def _quantize_q5_0(x: np.ndarray) -> np.ndarray:
    codes, head = _symmetric_codes(x, 16)
    return np.concatenate([head, _pack_fifth_bits(codes), _pack_nibbles(codes)], axis=1)


def _quantize_q5_1(x: np.ndarray) -> np.ndarray:
    codes, head = _offset_codes(x, 31)
    return np.concatenate([head, _pack_fifth_bits(codes), _pack_nibbles(codes)], axis=1)


def _pack_crumbs(lv: np.ndarray) -> np.ndarray:
    """2-bit levels uint8 [n, 256] -> Q2_K/Q3_K qs uint8 [n, 64] (inverse of _crumbs)."""
    q = (lv & 3).reshape(-1, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(q, axis=2).reshape(-1, 64)


def _quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref over super-blocks x [n, 256]: 16 groups of 16, each fitted by
    make_qkx2_quants (weights |x|) to scale*L - min, L in 0..3; scales and mins coded in 4 bits."""
    f32 = np.float32
    xs = x.reshape(-1, 16, 16)
    scales, mins = _make_qkx2_scales(xs, np.abs(xs), 3, -0.5, 0.1, 15)
    sc, d16 = _scale_code(scales, np.maximum(scales.max(axis=1), f32(0)), 15)
    m, dmin16 = _scale_code(mins, np.maximum(mins.max(axis=1), f32(0)), 15)
    d = f16_bits_to_f32(d16)[:, None] * sc.astype(f32)
    dm = f16_bits_to_f32(dmin16)[:, None] * m.astype(f32)
    live = d > 0
    lv = np.clip(_nearest_int((xs + dm[..., None]) / np.where(live, d, f32(1))[..., None]), 0, 3)
    lv = np.where(live[..., None], lv, 0).astype(np.uint8).reshape(-1, QK_K)
    return np.concatenate([sc | (m << 4), _pack_crumbs(lv), d16.reshape(-1, 1).view(np.uint8),
                           dmin16.reshape(-1, 1).view(np.uint8)], axis=1)


def _quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref over super-blocks x [n, 256]: 16 signed group scales (make_qx_quants,
    levels -4..3), coded in 6 bits against the largest one."""
    f32 = np.float32
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    scales = _make_qx_scales(xs, 4)
    max_scale = _signed_max(scales)
    live_block = np.abs(max_scale) >= GROUP_MAX_EPS
    iscale = f32(-32) / np.where(live_block, max_scale, f32(1))
    codes = np.clip(_nearest_int(iscale[:, None] * scales), -32, 31) + 32
    codes = np.where(live_block[:, None], codes, 32).astype(np.uint8)  # [n, 16], s + 32
    d16 = f32_to_f16_bits(np.where(live_block, f32(1) / iscale, f32(0)))
    d = f16_bits_to_f32(d16)[:, None] * (codes.astype(f32) - f32(32))
    live = d != 0
    lv = np.clip(_nearest_int(xs / np.where(live, d, f32(1))[..., None]), -4, 3) + 4
    lv = np.where(live[..., None], lv, 4).astype(np.uint8).reshape(n, QK_K)
    hmask = np.bitwise_or.reduce(((lv >> 2) & 1).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1),
                                 axis=1)
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:8] = (codes[:, 0:8] & 15) | ((codes[:, 8:16] & 15) << 4)
    high = (codes >> 4).reshape(n, 4, 4) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    packed[:, 8:12] = np.bitwise_or.reduce(high, axis=1)
    return np.concatenate([hmask, _pack_crumbs(lv), packed, d16.reshape(-1, 1).view(np.uint8)], axis=1)


_IQ4_MIDPOINTS = ((_IQ4_LEVELS[1:].astype(np.float32) + _IQ4_LEVELS[:-1]) / 2).astype(np.float32)


def _iq4_codes(v: np.ndarray) -> np.ndarray:
    """The IQ4 code of the level nearest each v (values in level units)."""
    return np.searchsorted(_IQ4_MIDPOINTS, v).astype(np.uint8)


def _iq4_scales(x: np.ndarray) -> np.ndarray:
    """quantize_iq4_nl_impl's scale search (no importance weights: x^2) for groups x [m, 32]: 15
    trial scales that put the group's largest value near the table's ends, each refitted by least
    squares; the one with the smallest weighted error wins."""
    f32 = np.float32
    vmax = _signed_max(x)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    vmax = np.where(zero, f32(1), vmax)
    w = x * x
    best_scale = vmax / f32(127)
    best = np.full(x.shape[0], -np.inf, f32)
    for step in range(-7, 8):
        q = _IQ4_LEVELS[_iq4_codes(x * ((f32(step) - f32(127)) / vmax)[:, None])].astype(f32)
        sumqx, sumq2 = (w * q * x).sum(axis=1), (w * q * q).sum(axis=1)
        scale = sumqx / np.where(sumq2 > 0, sumq2, f32(1))
        better = (sumq2 > 0) & (scale * sumqx > best)
        best_scale = np.where(better, scale, best_scale)
        best = np.where(better, scale * sumqx, best)
    return np.where(zero, f32(0), best_scale).astype(f32)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    d16 = f32_to_f16_bits(_iq4_scales(x))
    codes = _iq4_codes(x * _inverse(f16_bits_to_f32(d16))[:, None])
    return np.concatenate([d16.reshape(-1, 1).view(np.uint8), _pack_nibbles(codes)], axis=1)


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_xs_ref's layout: each 32-value sub-block's scale (as IQ4_NL's search) coded
    in 6 signed bits against the super-block's largest, d = -largest / 32."""
    f32 = np.float32
    n = x.shape[0]
    scales = _iq4_scales(x.reshape(-1, 32)).reshape(n, 8)
    d = -_signed_max(scales) / f32(32)
    codes = np.clip(_nearest_int(scales * _inverse(d)[:, None]), -32, 31).astype(np.int32) + 32
    d16 = f32_to_f16_bits(d)
    dl = f16_bits_to_f32(d16)[:, None] * (codes.astype(f32) - f32(32))
    q = _iq4_codes(x.reshape(n, 8, 32) * _inverse(dl.reshape(-1)).reshape(n, 8, 1))
    q = np.where((dl != 0)[..., None], q, _iq4_codes(np.zeros(1, f32))[0])
    high = ((codes >> 4) << np.arange(0, 16, 2)).sum(axis=1).astype(np.uint16)
    low = (codes[:, 0::2] & 15) | ((codes[:, 1::2] & 15) << 4)
    return np.concatenate([d16.reshape(-1, 1).view(np.uint8), high.reshape(-1, 1).view(np.uint8),
                           low.astype(np.uint8), _pack_nibbles(q.reshape(-1, 32)).reshape(n, 128)], axis=1)


_QUANTIZE_BLOCKS = {
    TensorType.Q2_K: _quantize_q2_k,
    TensorType.Q3_K: _quantize_q3_k,
    TensorType.IQ4_NL: _quantize_iq4_nl,
    TensorType.IQ4_XS: _quantize_iq4_xs,
    TensorType.Q4_0: _quantize_q4_0,
    TensorType.Q4_1: _quantize_q4_1,
    TensorType.Q5_0: _quantize_q5_0,
    TensorType.Q5_1: _quantize_q5_1,
    TensorType.Q8_0: quantize_q8_0,  # blocks [n, 32] -> [n, 34]
    TensorType.Q4_K: _quantize_q4_k,
    TensorType.Q5_K: _quantize_q5_k,
    TensorType.Q6_K: _quantize_q6_k,
}
