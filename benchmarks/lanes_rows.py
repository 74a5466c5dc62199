"""The Q8_0 decode-lanes tile's row order, measured: 4 adjacent rows per tile against the quarters of a
row group (decode_lanes.rows itself, group by group as the drivers call it), one thread, 8 tokens,
weights from DRAM and from L3.

Four adjacent rows' 34-byte blocks, taken in turn, are 4 streams a row apart inside one 4 KB page,
which the hardware prefetcher does not follow; the quarters of a 32-row group are 4 streams 8 rows
apart (docs/runtime.md, 2026-12-03 15:10). Both orders compute every row's result with the same
operations, and the script checks that they give the same bits before it times them, alternating
the two in one process (this VM's speed drifts between runs).

    python benchmarks/lanes_rows.py [--cols 768] [--rounds 12]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit

from ember.kernels.cpu import decode_lanes, int8_dots
from ember.kernels.cpu.quant_matmul import _MATVEC_ROWS
from ember.kernels.tensor_types import TensorType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_rows import random_weight  # noqa: E402 (a sibling script)

_Q8_0 = int(TensorType.Q8_0)
_TILE = decode_lanes._in_place_tile(decode_lanes._TILE_ROWS)


@njit(nogil=True)
def _adjacent(u8, lanes, out, reps):
    for _ in range(reps):
        for r in range(0, u8.shape[0], decode_lanes._TILE_ROWS):
            _TILE(u8, r, 1, lanes, 0, 8, out)


@njit(nogil=True)
def _quarters(u8, lanes, out, reps):  # the drivers' row groups through decode_lanes.rows itself
    for _ in range(reps):
        for first in range(0, u8.shape[0], _MATVEC_ROWS):
            decode_lanes.rows(_Q8_0, u8, first, first + _MATVEC_ROWS, lanes, out)


def _lanes(cols: int, rng: np.random.Generator) -> np.ndarray:
    lanes = decode_lanes.room_for(8, cols)
    for t in range(8):
        xq, xd, xs = np.empty(cols, np.int8), np.empty(cols // 32, np.float32), np.empty(cols // 32, np.float32)
        int8_dots.quantize_activation(rng.standard_normal(cols).astype(np.float32), xq, xd, xs)
        decode_lanes.put_token(xq, xd, xs, t, lanes)
    return lanes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cols", type=int, default=768, help="a multiple of 32 (the 100M model's rows: 768)")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    if not decode_lanes.MIN_TOKENS < 1 << 20:
        raise SystemExit("this CPU has neither AVX-512 VNNI nor AVX2: the decode lanes are not used")
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    lanes = _lanes(args.cols, rng)
    row_bytes = args.cols // 32 * 34
    for where, megabytes in (("DRAM", 53), ("L3", 1.6)):
        rows = int(megabytes * 1e6 / row_bytes) // _MATVEC_ROWS * _MATVEC_ROWS
        u8 = random_weight(TensorType.Q8_0, rows, args.cols, rng)
        reps = max(1, int(40e6 / u8.nbytes))
        outs = {}
        for name, fn in (("adjacent", _adjacent), ("quarters", _quarters)):
            outs[name] = np.zeros((8, rows), np.float32)
            fn(u8, lanes, outs[name], 1)
        if not np.array_equal(outs["adjacent"].view(np.uint32), outs["quarters"].view(np.uint32)):
            raise SystemExit("the two row orders gave different bits")
        times: dict[str, list[float]] = {"adjacent": [], "quarters": []}
        for _ in range(args.rounds):
            for name, fn in (("adjacent", _adjacent), ("quarters", _quarters)):
                start = time.perf_counter()
                fn(u8, lanes, outs[name], reps)
                times[name].append((time.perf_counter() - start) / reps)
        for name, ts in times.items():
            ts.sort()
            print(f"{where:4s} {rows} x {args.cols} ({u8.nbytes / 1e6:.1f} MB) {name:8s}: min {ts[0] * 1e3:.3f} ms, "
                  f"median {ts[len(ts) // 2] * 1e3:.3f} ms, {u8.nbytes / ts[0] / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
