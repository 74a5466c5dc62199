"""One-token decode rows as a step runs them, measured: 12 layers' matrices (the 100M model's shapes),
from DRAM, 2 threads, each thread its contiguous half of every matrix's row groups, one group per
call of quant_matmul._rows_tiles (as the decode team and the parallel drivers call it), against the
same pair tiles called in a loop of their own (the bound: no driver around them).

Until 2026-12-03 the driver's loop served every token count in one body, and LLVM kept the one-token
pair tile's constants on the stack there, reloading them every row pair: the Q4_K layers took 1.37 ms
through it against 1.22 ms through the pairs alone (docs/runtime.md, 2026-12-03 evening). The script
checks that both give the same bits, then alternates them in one process (this VM's speed drifts
between runs), a 64 MB read between runs pushing the weights out of L3.

    python benchmarks/decode_rows.py [--type Q4_K] [--rounds 15] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit, prange

from ember.kernels.cpu import int8_dots
from ember.kernels.cpu.quant_matmul import _MATVEC_ROWS, _Q8_0_ACTIVATIONS, _rows_tiles
from ember.kernels.tensor_types import TensorType, row_bytes

# (rows, cols) of one layer of the 100M model: q, k, v, o, gate, up; down
_LAYER = ((768, 768), (256, 768), (256, 768), (768, 768), (2048, 768), (2048, 768), (768, 2048))
_LAYERS = 12
# where each type keeps its f16 scales: (block bytes, byte offsets of the f16 fields)
_SCALES = {TensorType.Q8_0: (34, (0,)), TensorType.Q4_K: (144, (0, 2)), TensorType.Q6_K: (210, (208,))}


def random_weight(tt: TensorType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of type tt with sane f16 scales (0.001-0.011): every other byte is a valid code."""
    data = rng.integers(0, 256, (rows, row_bytes(tt, cols)), dtype=np.uint8)
    size, fields = _SCALES[tt]
    blocks = data.reshape(rows, -1, size)
    for at in fields:
        scales = (rng.random(blocks.shape[:2]) * 0.01 + 0.001).astype(np.float16)
        blocks[:, :, at:at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return data


def _activations(tt: TensorType, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """One token's quantized activations in the format tt's tiles take."""
    x = rng.standard_normal(cols).astype(np.float32)
    q8_0 = bool(_Q8_0_ACTIVATIONS[int(tt)])
    per = 32 if q8_0 else 256
    xq, xd, xs = np.empty((1, cols), np.int8), np.empty((1, cols // per), np.float32), np.empty((1, cols // 32), np.float32)
    (int8_dots.quantize_activation if q8_0 else int8_dots.quantize_activation_k)(x, xq[0], xd[0], xs[0])
    xc = np.empty((1, int8_dots.offsets_width(cols, not q8_0)), np.int32)
    int8_dots.quad_offsets(xq[0], xc[0], int8_dots.Q8_0_OFFSET if q8_0 else int8_dots.Q6_K_OFFSET)
    return xq, xd, xs, xc


def _pairs(tiles):  # type: ignore[no-untyped-def]
    """Rows first..end-1 (an even count) by the type's one-token pair tile, in a loop of their own."""
    pair = tiles[int8_dots.ROW_PAIR]

    @njit(nogil=True)
    def rows(tt, u8, first, end, xq, xd, xs, xc, out):
        for r in range(first, end, 2):
            v = pair(u8, r, xq, xd, xs, xc, 0)
            out[0, r], out[0, r + 1] = v[0], v[1]

    return rows


def _halves(rows_fn):  # type: ignore[no-untyped-def]
    """Every matrix's row groups, each thread its contiguous half, one call a group."""

    @njit(nogil=True, parallel=True)
    def run(tt, ws, acts, outs, threads):
        for me in prange(threads):
            for k in range(len(ws)):
                u8 = ws[k]
                xq, xd, xs, xc = acts[k]
                groups = (u8.shape[0] + _MATVEC_ROWS - 1) // _MATVEC_ROWS
                for c in range(me * groups // threads, (me + 1) * groups // threads):
                    rows_fn(tt, u8, c * _MATVEC_ROWS, min(u8.shape[0], (c + 1) * _MATVEC_ROWS), xq, xd, xs, xc,
                            outs[k])

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="Q4_K", choices=[t.name for t in _SCALES])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    tt = TensorType[args.type]
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    by_cols = {cols: _activations(tt, cols, rng) for cols in (768, 2048)}
    ws, acts, outs = numba.typed.List(), numba.typed.List(), numba.typed.List()
    for _ in range(_LAYERS):
        for rows, cols in _LAYER:
            ws.append(random_weight(tt, rows, cols, rng))
            acts.append(by_cols[cols])
            outs.append(np.zeros((1, rows), np.float32))
    megabytes = sum(w.nbytes for w in ws) / 1e6
    tiles = getattr(int8_dots, f"{tt.name}_TILES")
    drivers = {"_rows_tiles": _halves(_rows_tiles), "pairs alone": _halves(_pairs(tiles))}
    results = {}
    for name, run in drivers.items():
        run(int(tt), ws, acts, outs, args.threads)
        results[name] = np.concatenate([o.ravel() for o in outs])
    if not np.array_equal(*results.values()):
        raise SystemExit("the two loops gave different bits")
    flush = np.ones(64 << 17)  # 64 MB
    times: dict[str, list[float]] = {name: [] for name in drivers}
    for _ in range(args.rounds):
        for name, run in drivers.items():
            flush.sum()
            start = time.perf_counter()
            run(int(tt), ws, acts, outs, args.threads)
            times[name].append(time.perf_counter() - start)
    print(f"{tt.name}, {_LAYERS} layers of {len(_LAYER)} matrices, {megabytes:.1f} MB, one token, "
          f"{args.threads} threads, {args.rounds} alternating rounds (bits equal)")
    for name, spent in times.items():
        spent.sort()
        median = spent[len(spent) // 2]
        print(f"  {name:12s} median {median * 1e3:6.2f} ms ({megabytes / 1e3 / median:5.1f} GB/s), "
              f"best {spent[0] * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
