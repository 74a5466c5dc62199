"""CPU decode speed: ember vs llama.cpp (llama-cpp-python) on the same GGUF file, same threads, one run.

Writes random-weight GGUF files of a ~100M-parameter qwen3 shape (hidden 768, 12 layers, 12 heads on
4 KV heads, FFN 2048, vocab 32000, tied embeddings) at Q8_0 and Q4_K_M (cached under
benchmarks/.cache), then for each engine: load time, resident memory growth vs file size, and decode
tok/s of a greedy loop of 64 tokens after a 16-token prompt, median of 3 runs, with the weight bytes
read per token / step time as achieved GB/s. Prints ember/llama.cpp ratios.

    python benchmarks/cpu_decode.py [--tokens 64] [--repeats 3] [--threads N]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the GGUF writer the oracle tests use

from gguf_writer import Q4_K_M, write_gguf  # noqa: E402

from ember.kernels.tensor_types import TensorType  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=2048,
             rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
FORMATS = {"Q8_0": {"*": TensorType.Q8_0}, "Q4_K_M": Q4_K_M}


def make_file(name: str) -> Path:
    path = HERE / ".cache" / f"qwen3-100m-{name.lower()}.gguf"
    if path.exists():
        return path
    from transformers import Qwen3Config

    config = Qwen3Config(**SHAPE)
    rng = np.random.default_rng(0)
    h, f, hd = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"]
    q, kv = SHAPE["num_attention_heads"] * hd, SHAPE["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (SHAPE["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f)}
    state = {k: (np.ones(s, np.float32) if len(s) == 1 else rng.standard_normal(s, np.float32) * 0.02)
             for k, s in shapes.items()}
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_gguf(tmp, config, state, FORMATS[name])
    tmp.rename(path)
    return path


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads: every matrix once, the embedding table only as the (tied)
    output projection."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def bench_ember(path: Path, prompt: list[int], tokens: int, repeats: int) -> dict[str, float]:
    import ember

    rss0, t0 = rss_bytes(), time.perf_counter()
    model = ember.load(path)
    load_s = time.perf_counter() - t0
    list(model.generate(prompt, max_tokens=4, ignore_eos=True))  # compile / warm up
    times = []
    for _ in range(repeats):
        gen = model.generate(prompt, max_tokens=tokens + 1, ignore_eos=True)
        next(gen)  # the prompt is read and the first token sampled: decode starts here
        t = time.perf_counter()
        n = sum(1 for _ in gen)
        times.append((time.perf_counter() - t) / n)
    return {"load_s": load_s, "rss": rss_bytes() - rss0, "step_s": statistics.median(times)}


def bench_llama_cpp(path: Path, prompt: list[int], tokens: int, repeats: int, threads: int) -> dict[str, float]:
    from llama_cpp import Llama

    rss0, t0 = rss_bytes(), time.perf_counter()
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        llm.reset()
        gen = llm.generate(prompt, top_k=1, temp=0.0, reset=True)
        next(gen)
        t = time.perf_counter()
        for _ in range(tokens):
            next(gen)
        times.append((time.perf_counter() - t) / tokens)
    rss = rss_bytes() - rss0
    llm.close()
    return {"load_s": load_s, "rss": rss, "step_s": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    args = ap.parse_args()
    import numba

    numba.set_num_threads(args.threads)
    prompt = list(range(100, 116))
    print(f"machine: {os.cpu_count()} cpus, threads={args.threads}; shape: qwen3 hidden 768, 12 layers, FFN 2048, vocab 32000")
    print(f"{'file':8} {'engine':9} {'size MB':>8} {'load s':>7} {'RSS MB':>7} {'tok/s':>7} {'GB/s':>6}")
    for name in args.formats:
        path = make_file(name)
        size, per_token = path.stat().st_size, bytes_per_token(path)
        results = {"ember": bench_ember(path, prompt, args.tokens, args.repeats)}
        gc.collect()
        results["llama.cpp"] = bench_llama_cpp(path, prompt, args.tokens, args.repeats, args.threads)
        for engine, r in results.items():
            print(f"{name:8} {engine:9} {size / 1e6:8.1f} {r['load_s']:7.2f} {r['rss'] / 1e6:7.1f} "
                  f"{1 / r['step_s']:7.1f} {per_token / r['step_s'] / 1e9:6.1f}")
        print(f"{name:8} ratio ember/llama.cpp decode: {results['llama.cpp']['step_s'] / results['ember']['step_s']:.2f}x")


if __name__ == "__main__":
    main()
