"""The host sampler's cost per row (kernels/sampling_batch.py): building a step's SamplingBatch from its
rows and sampling it, on random logits of a given vocabulary, for the settings that cost differently:
plain temperature with top-p, the repetition penalty alone (greedy), and temperature with repetition
and frequency penalties over a 150-token history. Medians of 5 rounds.

    python benchmarks/sampler.py [--vocab 4096 32000] [--rows 1 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ember.kernels.sampling import SampleRow, SamplingParams
from ember.kernels.sampling_batch import SamplingBatch, sample_batch

CASES = {"t=0.8 top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
         "greedy, repetition 1.1": SamplingParams(repetition_penalty=1.1),
         "t=0.8, repetition 1.1, frequency 0.2": SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                                                               frequency_penalty=0.2)}


def per_row_us(params: SamplingParams, vocab: int, n: int, rounds: int = 5, calls: int = 200) -> float:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    rows = [SampleRow(k, params, np.random.default_rng(k), list(rng.integers(0, vocab, 100)),
                      list(rng.integers(0, vocab, 50)), False) for k in range(n)]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            sample_batch(logits, SamplingBatch.of(rows))
        times.append((time.perf_counter() - start) / calls / n)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    print(f"{'case':40s} {'vocab':>6s} {'rows':>4s} {'us/row':>8s}")
    for name, params in CASES.items():
        for vocab in args.vocab:
            for n in args.rows:
                print(f"{name:40s} {vocab:6d} {n:4d} {per_row_us(params, vocab, n):8.1f}", flush=True)


if __name__ == "__main__":
    main()
