"""A MoE decode step's experts on the CPU's threads: one group a thread, or every group split over them.

kernels/cpu/expert_ffn.py runs a step's expert groups (the pairs routed to one expert) each on one
thread, all in one parallel region (_experts_apart). The way it replaced: every group's gate/up and
down split over the threads, two parallel regions a group. Both are timed here in one process,
alternated, on 8 random Q8_0 experts of 192 x 2048 (top-8 routing: every token in every group), and
their outputs checked bit for bit against each other.

    python benchmarks/expert_groups.py [--threads 2] [--tokens 1,2,8] [--calls 300]

Prints microseconds per step (best of 5 batches of --calls) and GB/s of the experts' bytes. The 10 MB
of experts stay in a 32 MB L3 between calls: the figure is the threads' overhead and compute, not
DRAM's (a model's layers of them stream from memory).
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from numba import njit

from ember.kernels.cpu.expert_ffn import _expert, _groups, expert_table
from ember.kernels.cpu.quant_matmul import pack
from ember.kernels.ops import ExpertWeights
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference.quant import quantize
from ember.kernels.tensor_types import TensorType

HIDDEN, FFN, EXPERTS = 2048, 192, 8


@njit(cache=False, nogil=True)
def split_groups(x, table, bounds, token, weight, force, out):
    """_groups as it ran before: group after group, each group's kernels over the threads."""
    y = np.empty((bounds[table.shape[0]], x.shape[1]), np.float32)
    for g in range(table.shape[0]):
        _expert(x, table, bounds, token, g, force, False, y)
    for p in range(bounds[table.shape[0]]):
        for j in range(x.shape[1]):
            out[token[p], j] += y[p, j] * weight[p]


def best_us(step, calls: int) -> float:
    step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,8")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    rng = np.random.default_rng(0)

    def weight(rows: int, cols: int):  # type: ignore[no-untyped-def]
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return pack(RawTensor("w", TensorType.Q8_0, (rows, cols), quantize(TensorType.Q8_0, w)))

    experts = {e: ExpertWeights(weight(FFN, HIDDEN), weight(FFN, HIDDEN), weight(HIDDEN, FFN)) for e in range(EXPERTS)}
    table = expert_table(experts, EXPERTS).rows
    nbytes = sum(w.u8.nbytes for ws in experts.values() for w in (ws.gate, ws.up, ws.down))
    print(f"threads: {numba.get_num_threads()}; {EXPERTS} Q8_0 experts of {FFN} x {HIDDEN}, {nbytes / 1e6:.2f} MB")
    for n in (int(t) for t in args.tokens.split(",")):
        x = rng.standard_normal((n, HIDDEN)).astype(np.float32)
        token = np.tile(np.arange(n, dtype=np.int64), EXPERTS)  # every token in every group
        bounds = np.arange(EXPERTS + 1, dtype=np.int64) * n
        weights = rng.random(n * EXPERTS).astype(np.float32)
        apart, split = np.zeros((n, HIDDEN), np.float32), np.zeros((n, HIDDEN), np.float32)
        _groups(x, table, bounds, token, weights, 2, apart, False)
        split_groups(x, table, bounds, token, weights, 2, split)
        if not np.array_equal(apart.view(np.uint32), split.view(np.uint32)):
            raise SystemExit(f"{n} tokens: the two ways differ")
        times: dict[str, list[float]] = {"one a thread": [], "split": []}
        for _ in range(2):
            times["one a thread"].append(best_us(lambda: _groups(x, table, bounds, token, weights, 2, apart, False),
                                                 args.calls))
            times["split"].append(best_us(lambda: split_groups(x, table, bounds, token, weights, 2, split), args.calls))
        line = ", ".join(f"{k} {min(v):.0f} us ({nbytes / min(v) / 1e3:.1f} GB/s)" for k, v in times.items())
        print(f"{n} token{'s' if n > 1 else ''}: {line}", flush=True)


if __name__ == "__main__":
    main()
