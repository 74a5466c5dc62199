"""numpy-facing calls into the host harness (tests/cuda/native_harness.cu, built by native_toolchain):
each takes and returns numpy arrays shaped as the native kernels' device buffers are."""
from __future__ import annotations

import ctypes
import numpy as np

from ember.kernels.cuda.native_launch import NativeKv
from ember.kernels.cuda.repack import Repacked
from ember.kernels.tensor_types import TensorType

WEIGHT_CODES = {TensorType.F16: 1, TensorType.BF16: 2, TensorType.Q8_0: 3, TensorType.Q4_K: 4, TensorType.Q5_K: 5,
                TensorType.Q6_K: 6}
KV_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3}
EPILOGUES = {"store": 0, "add": 1, "swiglu": 2}


def aligned(a: np.ndarray) -> np.ndarray:
    """A copy of `a` at a 64-byte boundary: the kernels' 16-byte loads assume aligned rows."""
    a = np.ascontiguousarray(a)
    buf = np.empty(a.nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _ptr(a: np.ndarray | None) -> ctypes.c_void_p | None:
    return None if a is None or a.size == 0 else ctypes.c_void_p(a.ctypes.data)


class Harness:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name in ("harness_gemv", "harness_unit_values", "harness_attention", "harness_qk_rope_kv",
                     "harness_dequantize_f16", "harness_embed"):
            getattr(lib, name).restype = ctypes.c_int

    def unit_values(self, w: Repacked) -> np.ndarray:
        arrays = [aligned(a) for a in w.arrays]
        out = np.zeros((w.rows, w.cols), np.float32)
        assert self.lib.harness_unit_values(WEIGHT_CODES[w.ttype], *map(_ptr, arrays), w.rows, w.cols, _ptr(out)) == 0
        return out

    def quantize(self, x: np.ndarray, weight: np.ndarray | None = None,
                 eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(xf, xq, xd) of rows x [B, K]: RMS-normed by `weight` when given, then q8_1."""
        x = aligned(np.asarray(x, np.float32))
        b, k = x.shape
        xf, xq = np.zeros((b, k), np.float32), aligned(np.zeros((b, k), np.int8))
        xd = aligned(np.zeros((b, k // 32, 2), np.float32))
        w = None if weight is None else aligned(np.asarray(weight, np.float32))
        self.lib.harness_norm_quantize(int(w is not None), b, _ptr(x), _ptr(w), ctypes.c_float(eps), k, _ptr(xf),
                                       _ptr(xq), _ptr(xd))
        return xf, xq, xd

    def gemv(self, w: Repacked, x: np.ndarray, epilogue: str = "store", w2: Repacked | None = None,
             y: np.ndarray | None = None) -> np.ndarray:
        """The GEMV of x [B, K] against w [N, K] (and w2 for swiglu); `add` adds into y."""
        x = np.asarray(x, np.float32)
        b = x.shape[0]
        xf, xq, xd = self.quantize(x)
        xf = aligned(x)
        out = aligned(np.zeros((b, w.rows), np.float32) if y is None else np.asarray(y, np.float32))
        first = [aligned(a) for a in w.arrays]
        second = [aligned(a) for a in (w2 or w).arrays]
        code = self.lib.harness_gemv(WEIGHT_CODES[w.ttype], b, EPILOGUES[epilogue], *map(_ptr, first),
                                     *map(_ptr, second), _ptr(xq), _ptr(xd), _ptr(xf), _ptr(out), w.rows, w.cols)
        assert code == 0, f"no harness GEMV for batch {b}"
        return out

    def attention(self, q: np.ndarray, k: NativeKv, v: NativeKv, tables: np.ndarray, lengths: np.ndarray, scale: float,
                  splits: int, heads_per_block: int, out: np.ndarray | None = None) -> np.ndarray:
        q = aligned(np.asarray(q, np.float32))
        batch, q_heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k.data.shape
        tables, lengths = aligned(np.asarray(tables, np.int32)), aligned(np.asarray(lengths, np.int32))
        out = aligned(np.zeros(q.shape, np.float32) if out is None else out)
        part_acc = aligned(np.zeros((batch, q_heads, splits, head_dim), np.float32))
        part_ml = aligned(np.zeros((batch, q_heads, splits, 2), np.float32))
        code = self.lib.harness_attention(KV_CODES[k.dtype], head_dim // 32, heads_per_block, splits, batch, _ptr(q),
                                          _ptr(k.data), _ptr(k.scales), _ptr(v.data), _ptr(v.scales), _ptr(tables),
                                          _ptr(lengths), tables.shape[1], block_size, q_heads, kv_heads,
                                          ctypes.c_float(scale), _ptr(part_acc), _ptr(part_ml))
        assert code == 0, "no harness attention for these parameters"
        self.lib.harness_attention_combine(batch, _ptr(part_acc), _ptr(part_ml), _ptr(lengths), q_heads, head_dim,
                                           splits, _ptr(out))
        return out

    def qk_rope_kv(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: NativeKv, v_cache: NativeKv,
                   positions: np.ndarray, slots: np.ndarray, inv_freq: np.ndarray, interleaved: bool,
                   q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None, eps: float = 1e-6) -> np.ndarray:
        """Rotated (and normed) q, returned; k and v written into the caches at `slots`."""
        q = aligned(np.asarray(q, np.float32))
        batch, q_heads, head_dim = q.shape
        k, v = aligned(np.asarray(k, np.float32)), aligned(np.asarray(v, np.float32))
        norms = [None if n is None else aligned(np.asarray(n, np.float32)) for n in (q_norm, k_norm)]
        inv = aligned(np.asarray(inv_freq, np.float32))
        pos, sl = aligned(np.asarray(positions, np.int32)), aligned(np.asarray(slots, np.int64))
        code = self.lib.harness_qk_rope_kv(KV_CODES[k_cache.dtype], head_dim // 32, batch, _ptr(q), _ptr(k), _ptr(v),
                                           None, None, None, *map(_ptr, norms), ctypes.c_float(eps), _ptr(inv),
                                           2 * len(inv_freq), int(interleaved), _ptr(pos), _ptr(sl), q_heads, k.shape[1],
                                           _ptr(k_cache.data), _ptr(k_cache.scales), _ptr(v_cache.data),
                                           _ptr(v_cache.scales))
        assert code == 0, "no harness qk_rope_kv for these parameters"
        return q

    def sample(self, logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, uniform: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token, max, log-sum-exp) per row of penalised logits [rows, vocab]."""
        logits = np.ascontiguousarray(logits, np.float32)
        rows, vocab = logits.shape
        args = [np.ascontiguousarray(a, t) for a, t in ((temperature, np.float32), (top_k, np.int32),
                                                        (top_p, np.float64), (min_p, np.float64),
                                                        (uniform, np.float64))]
        tokens, values = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
        best, log_total = np.zeros(rows, np.float32), np.zeros(rows, np.float64)
        self.lib.harness_sample(rows, _ptr(logits), vocab, *map(_ptr, args), _ptr(tokens), _ptr(values), _ptr(best),
                                _ptr(log_total))
        return tokens, best, log_total

    def dp4a_vsub4(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a, b = np.ascontiguousarray(a, np.int32), np.ascontiguousarray(b, np.int32)
        dots, diffs = np.zeros_like(a), np.zeros_like(a)
        self.lib.harness_dp4a_vsub4(_ptr(a), _ptr(b), len(a), _ptr(dots), _ptr(diffs))
        return dots, diffs

    def halves(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(f16 bits, bf16 bits, the f16 bits back to float32) of float32 x, by the kernels' conversions."""
        x = np.ascontiguousarray(x, np.float32)
        f16, bf16, back = np.zeros(x.shape, np.uint16), np.zeros(x.shape, np.uint16), np.zeros(x.shape, np.float32)
        self.lib.harness_f16(_ptr(x), len(x), _ptr(f16), _ptr(bf16), _ptr(back))
        return f16, bf16, back
