"""Decode of a Qwen3-8B-shaped model on the native kernels, eager and as a captured CUDA graph, beside
llama.cpp's H100 anchors (../shared/notes/ANCHORS.md).

    python benchmarks/gpu_decode.py [--out DIR]    # on a GPU: a table, and gpu_decode.json
    python benchmarks/gpu_decode.py --dry-run      # anywhere: the same script at toy shapes, no device

The model is daemon/runner/native_decoder.py's NativeDecoder over random weights built on the device
(hidden 4096, 36 layers, 32 query and 8 KV heads of 128, FFN 12288, vocabulary 151936): Q8_0
throughout, and a Q4_K_M-like mix (Q6_K for attn_v, ffn_down and the output, Q4_K elsewhere). Each row
decodes at 512 tokens of context in an f16 cache. Per batch size (1, 8 and 32): the eager step (Python
launching every kernel), and the step captured once as a graph and replayed (best of 5 timed runs of 20
replays); tokens/s, and at batch 1 the bytes a step must read (weights and KV) over its time against
the HBM read bandwidth measured in the same run. The graph's logits must equal the eager step's.
Not yet measured here: prefill (NativeDecoder.prefill's GEMMs) beside llama.cpp's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from ember.daemon.runner.native_decoder import DecoderShape, NativeDecoder
from ember.kernels.cuda.native_launch import NativeOps, to_host
from ember.kernels.tensor_types import TensorType

ANCHORS = {"Q4_K_M": 248.9, "Q8_0": 217.6}  # llama.cpp decode tok/s, H100, batch 1 (ANCHORS.md)
GOALS = {"Q4_K_M": 375.0}  # 1.5x llama.cpp; Q8_0: 80% of HBM
Q8_GOAL = 0.80
CONTEXT, BLOCK, REPLAYS, REPEATS = 512, 16, 5, 20
BATCHES = (1, 8, 32)  # streams decoding side by side
ROLES = ("embedding", "q", "k", "v", "o", "gate", "up", "down", "output")
QUANTS = {"Q8_0": dict.fromkeys(ROLES, TensorType.Q8_0),
          "Q4_K_M": dict(dict.fromkeys(ROLES, TensorType.Q4_K), v=TensorType.Q6_K, down=TensorType.Q6_K,
                         output=TensorType.Q6_K)}


def qwen3_8b() -> DecoderShape:
    inv_freq = (1.0 / 1e6 ** (np.arange(0, 128, 2) / 128)).astype(np.float32)
    return DecoderShape(4096, 36, 32, 8, 128, 12288, 151936, 1e-6, inv_freq, False)


def toy() -> DecoderShape:
    return DecoderShape(256, 2, 4, 2, 64, 512, 512, 1e-6, np.ones(32, np.float32), False)


def fill(decoder: NativeDecoder, bufs: Any, step: int) -> None:
    """Row r decodes its sequence's token at position CONTEXT - 1 + step, in its own blocks."""
    width = decoder.table_width
    tables = np.arange(bufs.batch * width).reshape(bufs.batch, width)
    decoder.fill(bufs, np.arange(bufs.batch) + 7 * step + 1, np.full(bufs.batch, CONTEXT - 1 + step), tables)


def measure(decoder: NativeDecoder, batch: int, xp: Any, dry: bool) -> dict[str, Any]:
    bufs = decoder.buffers(batch)
    fill(decoder, bufs, 0)
    decoder.step(bufs)  # compiles every kernel
    sync = (lambda: None) if dry else xp.cuda.Device().synchronize
    sync()
    t = time.perf_counter()
    for _ in range(3):
        decoder.step(bufs)
    sync()
    eager = (time.perf_counter() - t) / 3
    eager_logits = to_host(bufs.logits).copy()
    if dry:
        return {"batch": batch, "eager_ms": eager * 1e3, "graph_ms": None, "equal": True}
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        decoder.step(bufs)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        same = np.allclose(to_host(bufs.logits), eager_logits, rtol=1e-5, atol=1e-5)
        best = float("inf")
        start, stop = xp.cuda.Event(), xp.cuda.Event()
        for _ in range(REPLAYS):
            start.record(stream)
            for _ in range(REPEATS):
                graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            best = min(best, xp.cuda.get_elapsed_time(start, stop) / 1e3 / REPEATS)
    return {"batch": batch, "eager_ms": eager * 1e3, "graph_ms": best * 1e3, "equal": bool(same)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy shapes, numpy, kernels not run")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where gpu_decode.json goes")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.dry_run:
        xp, ops, shape, bandwidth = np, NativeOps(np, lambda kernel, grid, block, values: None), toy(), 1e12
        device = f"dry run on {platform.machine()} (no kernel runs)"
    else:
        import cupy  # noqa: PLC0415

        from gpu_kernels import hbm_read_bandwidth  # noqa: PLC0415 - beside this script

        xp, ops, shape = cupy, NativeOps.on_gpu(), qwen3_8b()
        bandwidth = hbm_read_bandwidth(cupy)
        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    result: dict[str, Any] = {"device": device, "hbm_read_tb_per_s": bandwidth / 1e12, "context": CONTEXT,
                              "date": time.strftime("%Y-%m-%d"), "quants": {}}
    print(f"{device}: HBM read {bandwidth / 1e12:.2f} TB/s; {'a toy' if args.dry_run else 'the Qwen3-8B'} shape, "
          f"random weights, {CONTEXT} tokens of context, f16 KV")
    for name, types in QUANTS.items():
        n_blocks = max(BATCHES) * -(-(CONTEXT + 8) // BLOCK)
        decoder = NativeDecoder.random(shape, ops, types, n_blocks, BLOCK, "f16", max_context=CONTEXT + 8)
        kv_bytes = 2 * shape.n_layers * CONTEXT * shape.n_kv_heads * shape.head_dim * 2
        rows = []
        for batch in BATCHES:
            r = measure(decoder, batch, xp, args.dry_run)
            for kind in ("eager", "graph"):
                ms = r[f"{kind}_ms"]
                r[f"{kind}_tok_per_s"] = None if ms is None else batch / (ms / 1e3)
            if r["graph_ms"] is not None and batch == 1:
                r["of_hbm"] = (decoder.weight_bytes + kv_bytes) / (r["graph_ms"] / 1e3) / bandwidth
            rows.append(r)
            graph = "-" if r["graph_tok_per_s"] is None else f"{r['graph_tok_per_s']:8.1f}"
            share = f" {r['of_hbm']:.0%} of HBM" if "of_hbm" in r else ""
            print(f"  {name:6} batch {batch}: eager {r['eager_tok_per_s']:8.1f} tok/s, graph {graph} tok/s{share}"
                  f"{'' if r['equal'] else '  GRAPH LOGITS DIFFER FROM EAGER'}")
        result["quants"][name] = {"weight_bytes": decoder.weight_bytes, "rows": rows,
                                  "llama_cpp_anchor_tok_per_s": ANCHORS[name]}
        one = rows[0]["graph_tok_per_s"]
        if one is not None:
            versus = one / ANCHORS[name]
            goal = (f"goal {GOALS[name]:.0f} tok/s: {'met' if one >= GOALS[name] else 'not met'}" if name in GOALS
                    else f"goal {Q8_GOAL:.0%} of HBM: {'met' if rows[0]['of_hbm'] >= Q8_GOAL else 'not met'}")
            print(f"  {name} batch 1: {versus:.2f}x llama.cpp's {ANCHORS[name]} tok/s (H100 anchor); {goal}")
        del decoder
    result["seconds"] = time.perf_counter() - started
    print(f"in {result['seconds']:.1f} s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
