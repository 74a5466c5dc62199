"""Throughput of the CPU quantized-weight kernels (kernels/cpu/quant_matmul.py), optionally vs llama.cpp.

For each type and shape: the matvec (n=1) time and GB/s of weight bytes read, and the n=16 kernel's
time and tokens/s through the matrix (16 / time); for the prompt rows' float kernel and, where the
type has one, the decode rows' integer kernel ("i8": the activation quantized to int8 blocks, as
decode runs every generated token). numpy float32 `W @ x` on the same shape is printed
for context. With --llama-cpp, ggml's own mul_mat on the same quantized bytes is timed too, through
ctypes into the libggml that llama-cpp-python ships: a graph of many mul_mat nodes computed with the
same thread count, so ggml's per-graph thread start is amortized as in a real decode graph.

    python3 benchmarks/quant_matmul.py [--types Q4_K,Q8_0] [--repeat 200] [--llama-cpp] [--prompt 512]
                                       [--decode-rows 8]

--prompt N times the prompt rows instead: N tokens through each type's 100M shapes (2048 x 768 and
768 x 2048), with f32 rows (prompt_act f32) and int8 ones (q8_0: kernels/cpu/int8_prompt.py), and
ggml's mul_mat of N tokens with --llama-cpp; ms and GOP/s (2 x rows x cols x N per second).

--decode-rows N times decode rows of 1 to N tokens instead (the integer tiles: 4 tokens a tile, then
one tile of the 2 or 3 left; from decode_lanes.MIN_TOKENS on, token lanes) through the 100M shapes, the
demo's and one past the L3 (16384 x 3072), each token's result checked bit for bit against the token
alone; ms and GOP/s. What a verification of n proposals and a batch of n streams cost.

Run from a checkout where `ember` is importable. Numba's thread count is used as is. Weights are
cache-resident after the first call (all these shapes fit a 32 MiB L3), as for llama.cpp here.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import time

import numba
import numpy as np

from ember.kernels.cpu.int8_prompt import INT8_PROMPT_TYPES
from ember.kernels.cpu.quant_matmul import matmul, pack
from ember.kernels.reference.quant import quantize
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import BLOCK_GEOMETRY, TensorType

# the trained MoE's (attention, an expert's gate/up and down, the head), the demo's, the 100M's
SHAPES = [(256, 256), (160, 256), (256, 160), (8192, 256), (640, 384), (1024, 384), (384, 1024), (2048, 768),
          (768, 2048), (32000, 768)]
TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]


def best_time(fn, repeat: int) -> float:
    """Fastest of `repeat` timed calls after warm-up.

    The minimum, not the median: on a shared 2-core VM another process holding one core stalls a
    2-thread kernel for a whole scheduler tick (~4 ms), which says nothing about the kernel.
    """
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.min(times))


def row(name: str, rows: int, cols: int, nbytes: int, t1: float, t16: float) -> str:
    return (f"{name:15} {rows:>5}x{cols:<5} {nbytes / 1e6:6.1f} {t1 * 1e6:8.1f} {nbytes / t1 / 1e9:6.1f} "
            f"{t16 * 1e6:9.1f} {16 / t16:8.0f}")


class GgmlMulMat:
    """ggml's mul_mat timed through llama-cpp-python's libggml (ctypes; no build needed)."""

    class _InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self, threads: int) -> None:
        import llama_cpp

        lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        self.base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        self.threads = threads
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        for name, res, args in [("ggml_init", vp, [self._InitParams]),
                                ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64]),
                                ("ggml_get_data", vp, [vp]), ("ggml_mul_mat", vp, [vp, vp, vp]),
                                ("ggml_new_graph_custom", vp, [vp, ctypes.c_size_t, ctypes.c_bool]),
                                ("ggml_build_forward_expand", None, [vp, vp]), ("ggml_free", None, [vp])]:
            fn = getattr(self.base, name)
            fn.restype, fn.argtypes = res, args
        self.cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]

    def time(self, ttype: TensorType, storage: np.ndarray, rows: int, cols: int, n: int, nodes: int) -> float:
        """Seconds per mul_mat of storage [rows, cols] by n float32 tokens (best of 5 graph runs)."""
        b = self.base
        mem = storage.nbytes + n * cols * 4 + nodes * (rows * n * 4 + 4096) + (64 << 20)
        ctx = b.ggml_init(self._InitParams(mem, None, False))
        try:
            w = b.ggml_new_tensor_2d(ctx, int(ttype), cols, rows)  # ggml order: ne0 = cols
            ctypes.memmove(b.ggml_get_data(w), storage.ctypes.data, storage.nbytes)
            x = b.ggml_new_tensor_2d(ctx, int(TensorType.F32), cols, n)
            xs = np.random.default_rng(1).standard_normal((n, cols)).astype(np.float32)
            ctypes.memmove(b.ggml_get_data(x), xs.ctypes.data, xs.nbytes)
            graph = b.ggml_new_graph_custom(ctx, nodes + 16, False)
            for _ in range(nodes):
                b.ggml_build_forward_expand(graph, b.ggml_mul_mat(ctx, w, x))
            run = lambda: self.cpu.ggml_graph_compute_with_ctx(ctx, graph, self.threads)  # noqa: E731
            return best_time(run, 5) / nodes
        finally:
            b.ggml_free(ctx)


def prompt_rows(names: list[str], n: int, ggml: GgmlMulMat | None) -> None:
    """n prompt tokens through each type's 100M shapes: f32 rows, int8 rows and (where given) ggml."""
    rng = np.random.default_rng(0)
    print(f"threads: {numba.get_num_threads()}, {n} tokens; ms (GOP/s)")
    for name in names:
        tt = TensorType[name]
        for rows, cols in ((2048, 768), (768, 2048)):
            storage = quantize(tt, rng.standard_normal((rows, cols)).astype(np.float32) * 0.02)
            cw = pack(RawTensor(name, tt, (rows, cols), storage))
            x = rng.standard_normal((n, cols)).astype(np.float32)
            ops = 2 * rows * cols * n / 1e9
            times = {"f32 rows": best_time(lambda: matmul(x, cw, False), 7)}
            if tt in INT8_PROMPT_TYPES:
                times["int8 rows"] = best_time(lambda: matmul(x, cw, False, int8_prompts=True), 7)
            if ggml is not None:
                times["ggml"] = ggml.time(tt, storage, rows, cols, n, 2)
            print(f"{name:7} {rows:>5}x{cols:<5} " + "  ".join(f"{k} {t * 1e3:6.2f} ({ops / t:4.0f})" for k, t in times.items()),
                  flush=True)


def decode_rows(names: list[str], most: int) -> None:
    """1..most decode tokens through each type's integer kernel (best of 7 x 15 calls), each result
    checked against its token alone."""
    rng = np.random.default_rng(0)
    print(f"threads: {numba.get_num_threads()}; ms (GOP/s) by tokens")
    for name in names:
        tt = TensorType[name]
        for rows, cols in ((1024, 384), (2048, 768), (768, 2048), (16384, 3072)):
            if cols % BLOCK_GEOMETRY[tt][0]:
                continue
            cw = pack(RawTensor(name, tt, (rows, cols), quantize(tt, rng.standard_normal((rows, cols)).astype(np.float32) * 0.02)))
            if not cw.int8:
                continue
            x = rng.standard_normal((most, cols)).astype(np.float32)
            alone = np.stack([matmul(x[t:t + 1], cw, True)[0] for t in range(most)])
            cells = []
            for n in range(1, most + 1):
                assert np.array_equal(matmul(x[:n], cw, True), alone[:n]), (name, rows, cols, n)
                calls = max(1, 15 * 2048 * 768 // (rows * cols))
                t = best_time(lambda: [matmul(x[:n], cw, True) for _ in range(calls)], 7) / calls
                cells.append(f"{n}: {t * 1e3:.3f} ({2 * rows * cols * n / t / 1e9:.0f})")
            print(f"{name:7} {rows:>5}x{cols:<5} " + "  ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--llama-cpp", action="store_true", help="also time ggml's mul_mat (needs llama-cpp-python)")
    ap.add_argument("--prompt", type=int, default=0, metavar="N", help="time prompt rows of N tokens instead")
    ap.add_argument("--decode-rows", type=int, default=0, metavar="N", help="time decode rows of 1..N tokens instead")
    args = ap.parse_args()
    if args.decode_rows:
        decode_rows(args.types.split(","), args.decode_rows)
        return
    ggml = GgmlMulMat(numba.get_num_threads()) if args.llama_cpp else None
    if args.prompt:
        prompt_rows(args.types.split(","), args.prompt, ggml)
        return
    rng = np.random.default_rng(0)
    print(f"threads: {numba.get_num_threads()}")
    print(f"{'kernel':15} {'shape':>11} {'MB':>6} {'n=1 us':>8} {'GB/s':>6} {'n=16 us':>9} {'tok/s':>8}")
    for rows, cols in SHAPES:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
        x1 = rng.standard_normal((1, cols)).astype(np.float32)
        x16 = rng.standard_normal((16, cols)).astype(np.float32)
        repeat = max(10, args.repeat * 2048 * 768 // (rows * cols))
        print(row("numpy f32", rows, cols, w.nbytes, best_time(lambda: w @ x1[0], repeat),
                  best_time(lambda: x16 @ w.T, repeat)))
        for name in args.types.split(","):
            tt = TensorType[name]
            if cols % BLOCK_GEOMETRY[tt][0]:  # e.g. K-quants' 256-value blocks in a 384-column row
                print(f"ember {name:10} {rows:>5}x{cols:<5} skipped: rows of {BLOCK_GEOMETRY[tt][0]}-value blocks")
                continue
            storage = quantize(tt, w)
            cw = pack(RawTensor(name, tt, (rows, cols), storage))
            t1 = best_time(lambda: matmul(x1, cw), repeat)
            t16 = best_time(lambda: matmul(x16, cw), repeat)
            print(row(f"ember {name}", rows, cols, cw.nbytes, t1, t16))
            if cw.int8:  # decode rows: the activation quantized to int8, integer dots (what decode runs)
                t1 = best_time(lambda: matmul(x1, cw, True), repeat)
                t16 = best_time(lambda: matmul(x16, cw, True), repeat)
                print(row(f"ember {name} i8", rows, cols, cw.nbytes, t1, t16))
            if ggml is not None:
                nodes = max(4, 100 * 2048 * 768 // (rows * cols))
                t1 = ggml.time(tt, storage, rows, cols, 1, nodes)
                t16 = ggml.time(tt, storage, rows, cols, 16, max(2, nodes // 8))
                print(row(f"ggml {name}", rows, cols, cw.nbytes, t1, t16), flush=True)


if __name__ == "__main__":
    main()
