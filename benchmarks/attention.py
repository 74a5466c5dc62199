"""The CPU attention kernel alone (kernels/cpu/paged_attention.py): one decode token after a long context.

For each KV dtype: microseconds per layer for one token attending to `--context` positions, with
`--layers` layers' caches taken in turn (their K and V together larger than the L3, so read from
memory, as a decode step reads them), and again with one layer's cache (hot). The default shape is
the 100M file's of benchmarks/cpu_decode.py (12 query heads on 4 KV heads of 64), whose "decode after
a 1536-token prompt" figure this kernel is most of beyond plain decode. Numba's thread count is used
as is (NUMBA_NUM_THREADS=1 for one thread).

    python benchmarks/attention.py [--context 1536] [--dtypes f16 f32 q8_0] [--layers 12]
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from ember.kernels.convert import KV_DTYPES
from ember.kernels.cpu.paged_attention import KVLayerStore, paged_attention

BLOCK = 16  # the engine's KV block size


def layer_caches(dtype: str, context: int, kv_heads: int, head_dim: int, rng: np.random.Generator
                 ) -> tuple[KVLayerStore, KVLayerStore]:
    blocks = -(-context // BLOCK)
    ids, offsets = np.repeat(np.arange(blocks), BLOCK)[:context], np.tile(np.arange(BLOCK), blocks)[:context]
    stores = []
    for _ in range(2):
        store = KVLayerStore.allocate(dtype, blocks, BLOCK, kv_heads, head_dim, keys=not stores)
        store.write(ids, offsets, rng.standard_normal((context, kv_heads, head_dim)).astype(np.float32))
        stores.append(store)
    return stores[0], stores[1]


def us_per_layer(layers: list[tuple[KVLayerStore, KVLayerStore]], q: np.ndarray, context: int, rounds: int) -> float:
    """Fastest of `rounds` passes over every layer, per layer."""
    tables = np.arange(-(-context // BLOCK), dtype=np.int32)[None, :]
    seq, pos = np.zeros(1, np.int32), np.array([context - 1], np.int64)  # the runner's index dtypes
    scale = 1 / np.sqrt(q.shape[2])
    for k, v in layers:
        paged_attention(q, k, v, tables, seq, pos, scale)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for k, v in layers:
            paged_attention(q, k, v, tables, seq, pos, scale)
        best = min(best, (time.perf_counter() - t0) / len(layers))
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=12, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12, help="caches taken in turn (from memory)")
    ap.add_argument("--dtypes", nargs="+", default=["f16", "f32", "bf16", "q8_0"], choices=KV_DTYPES)
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, args.heads, args.head_dim)).astype(np.float32)
    print(f"1 token, {args.context} positions, {args.heads} query heads on {args.kv_heads} KV heads of "
          f"{args.head_dim}, {numba.get_num_threads()} threads; us per layer, best of {args.rounds}")
    for dtype in args.dtypes:
        layers = [layer_caches(dtype, args.context, args.kv_heads, args.head_dim, rng) for _ in range(args.layers)]
        cold = us_per_layer(layers, q, args.context, args.rounds)
        hot = us_per_layer(layers[:1], q, args.context, args.rounds * args.layers)
        mb = sum(k.nbytes + v.nbytes for k, v in layers[:1]) / 1e6
        print(f"{dtype:>5}: {cold:7.1f} us ({args.layers} layers in turn, {mb * 1e6 / cold / 1e3:5.1f} GB/s of K and V)"
              f"   {hot:7.1f} us (one layer hot)")


if __name__ == "__main__":
    main()
