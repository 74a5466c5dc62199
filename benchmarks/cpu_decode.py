"""CPU speed, ember vs llama.cpp (llama-cpp-python) on the same GGUF files, same threads, one run.

Files: the trained demo model (daemon/assets, Q8_0) and a random-weight ~100M-parameter qwen3 shape
(hidden 768, 12 layers, 12 heads on 4 KV heads, FFN 2048, vocab 32000, tied embeddings), written as F16
and then quantized to Q8_0 and Q4_K_M (by default; --files also takes Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
IQ4_XS, Q2_K and Q3_K_M) by llama.cpp itself (`llama_model_quantize`; cached under benchmarks/.cache);
and `gemma4`, Gemma 4 31B's layout at ~86M parameters (GEMMA4_SHAPE: transformers' random init,
converted by llama.cpp's converter, Q4_K_M). For each file and engine, in a fresh process each (so load time and memory are that
engine's alone): load seconds (ember's kernel cache warm), resident memory growth over the load, the
decode and the prefill runs vs the file's size (measured after the same work has run once on a first
instance of the model, freed since: the model's memory, not the code each engine brings in on first use;
ember's batched run after them is reported apart: its 8 sequences' KV cache is not part of llama.cpp's
figure; so is its tokenizer's BPE, which ember builds on the first text encode and the token ids the
benchmark feeds never need, while llama.cpp builds its vocabulary at load), decode tok/s of a greedy
loop of --tokens tokens after a 16-token prompt (median of --repeats), and prefill tok/s of a
--prompt-token prompt (median of --repeats); for ember also the aggregate decode tok/s of --batch
sequences stepped together (median of --repeats), each run next to a one-stream decode run, and its
ratio to that run (the median of the pairs' ratios; also given against the decode figure); and
decode tok/s again after a --context token prompt (32 tokens; each engine in a context of that size,
after the figures above), where each token's attention reads the whole context. The two engines
alternate --rounds times per file and each figure is the median over the rounds. Decode is also
given as GB/s of weights read per token, and as a fraction of this machine's memory bandwidth,
measured here with the same threads. Prints ember/llama.cpp ratios.

    python benchmarks/cpu_decode.py [--tokens 128] [--repeats 3] [--rounds 3] [--threads N] [--prompt-tokens 512] [--batch 8]
                                    [--context 1536] [--kv-dtype f16] [--prompt-act q8_0|f32] [--files demo Q8_0 Q4_K_M ...]

--kv-dtype: ember's KV cache (default f16, ember's default and llama.cpp's; f32 reads twice the bytes
in the long-context figure). --prompt-act: ember's prompt activations (default: ember's own for this
CPU, q8_0 with AVX-512 VNNI, else f32; f32 for the exact float product).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the GGUF writer the oracle tests use

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=2048,
             rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
# llama.cpp's quantization types (llama.h LLAMA_FTYPE_MOSTLY_*) the 100M shape is measured in
LLAMA_FTYPES = ("Q8_0", "Q4_K_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K_M")
# Gemma 4 31B's layout at ~100M parameters: every 6th layer full (head_dim 128, 2 KV heads, values from
# keys, proportional rope), the rest sliding over 512 positions (head_dim 64, 4 KV heads), GELU-tanh
# FFN, sandwich norms, a soft-capped head; no KV sharing (llama.cpp aborts on it: docs/gemma4.md)
GEMMA4_SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=2,
                    attention_k_eq_v=True, sliding_window=512, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                    final_logit_softcapping=30.0, max_position_embeddings=4096, tie_word_embeddings=True)


def demo_file() -> Path:
    from ember.daemon.loader.demo_model import DEMO_MODEL

    return Path(DEMO_MODEL)


def f16_source() -> Path:
    """The 100M shape with random weights, stored F16 (llama.cpp quantizes from it)."""
    path = HERE / ".cache" / "qwen3-100m-f16.gguf"
    if path.exists():
        return path
    from transformers import Qwen3Config

    from ember.kernels.tensor_types import TensorType
    from gguf_writer import write_gguf

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
    write_gguf(tmp, Qwen3Config(**SHAPE), state, {"*": TensorType.F16})
    tmp.rename(path)
    return path


def quantized_by_llama_cpp(name: str, threads: int) -> Path:
    path = HERE / ".cache" / f"qwen3-100m-{name.lower()}-llamacpp.gguf"
    if path.exists():
        return path
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}"), threads
    tmp = path.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(f16_source()).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {name}")
    tmp.rename(path)
    return path


def gemma4_file(threads: int) -> Path:
    """The Gemma 4 shape: transformers' random init, with a Gemma-style tokenizer trained on the tests'
    text (its vocabulary, ~1100 tokens, is what the converter keeps), converted and quantized to
    Q4_K_M by llama.cpp."""
    path = HERE / ".cache" / "gemma4-100m-q4_k_m-llamacpp.gguf"
    if path.exists():
        return path
    import shutil

    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from llama_cpp_tools import convert, quantize
    from tiny_models import write_gemma_tokenizer

    work = HERE / ".cache" / "gemma4-100m-work"
    (work / "hf").mkdir(parents=True, exist_ok=True)
    vocab = write_gemma_tokenizer(work / "hf")
    torch.manual_seed(0)
    config = Gemma4TextConfig(**GEMMA4_SHAPE, vocab_size=vocab, vocab_size_per_layer_input=vocab)
    Gemma4ForCausalLM(config).eval().save_pretrained(work / "hf")
    f16 = convert(work / "hf", work / "f16.gguf", "f16")
    quantize(f16, path.with_suffix(".tmp"), "Q4_K_M").rename(path)
    shutil.rmtree(work)
    return path


def bytes_per_token(path: Path) -> int:
    """Weight bytes a decode step reads: every matrix once (the tied embedding only as the output)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def memory_bandwidth(threads: int) -> float:
    """Read bandwidth (GB/s) of a 1 GiB array summed by `threads` numba threads."""
    import numba

    @numba.njit(parallel=True, fastmath=True)
    def total(a):
        s = np.float32(0)
        for i in numba.prange(a.size):
            s += a[i]
        return s

    numba.set_num_threads(threads)
    a = np.ones(1 << 28, np.float32)
    total(a)
    best = min(_timed(lambda: total(a)) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --------------------------------------------------------------------------------------------------
# one engine on one file, in its own process
# --------------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_ember(path: Path, args: argparse.Namespace) -> dict[str, float]:
    import numba

    import ember

    numba.set_num_threads(args.threads)
    first = ember.load(path, kv_dtype=args.kv_dtype, prompt_act=args.prompt_act)  # compiles or loads the kernels: the timed load finds them ready
    warm_up(first.generate, args)  # and the code that runs below is loaded (a decode burst's alone: ~13 MB, once)
    del first
    gc.collect()
    rss0 = rss_bytes()
    t = time.perf_counter()
    model = ember.load(path, kv_dtype=args.kv_dtype, prompt_act=args.prompt_act)
    load_s = time.perf_counter() - t
    step_s, prefill_s = decode_and_prefill(model, args)
    rss = rss_bytes() - rss0  # the work llama.cpp's figure covers: load, decode, prefill
    pairs = [batched_beside_one(model, args, k % 2 == 1) for k in range(args.repeats)] if args.batch else [(0.0, 0.0, 0)]
    batched = statistics.median(tok_s for tok_s, _, _ in pairs)
    batch_x = statistics.median(tok_s * one_s for tok_s, one_s, _ in pairs)
    batch_rss = max(after for _, _, after in pairs) - rss0 - rss if args.batch else 0
    long_step_s = decode_after(model, long_context_prompt(args), LONG_TOKENS, args.repeats) if args.context else 0.0
    before = rss_bytes()
    model.tokenize("Hello")  # the first text encode builds the tokenizer's BPE (token ids alone never need it)
    return {"load_s": load_s, "rss": rss, "step_s": step_s, "prefill_s": prefill_s, "batch_tok_s": batched,
            "batch_x": batch_x, "batch_rss": batch_rss, "long_step_s": long_step_s, "bpe_rss": rss_bytes() - before}


DECODE_PROMPT = list(range(100, 116))  # the 16 tokens before each decode figure's tokens, both engines


def warm_up(generate, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """Run the measured work's shapes once on a first instance of the model, so that the RSS figure is
    the model's own memory and not the code either engine brings in on first use (ember: numba's
    compiled functions, loaded from its cache per signature, ~4 MB beyond the burst; llama.cpp: its
    libraries' pages and thread pool)."""
    for prompt, tokens in (([100], 24), (DECODE_PROMPT, 8), (list(range(100, 100 + args.prompt_tokens)), 1)):
        list(generate(prompt, max_tokens=tokens, ignore_eos=True))


def decode_and_prefill(model, args: argparse.Namespace) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds per decoded token after a 16-token prompt, and median seconds to read a prompt of
    args.prompt_tokens (and sample one token), over args.repeats runs each."""
    prompt, long_prompt = DECODE_PROMPT, list(range(100, 100 + args.prompt_tokens))
    list(model.generate(prompt, max_tokens=4, ignore_eos=True))  # warm up
    step = decode_after(model, prompt, args.tokens, args.repeats)
    prefill = [_timed(lambda: list(model.generate(long_prompt, max_tokens=1, ignore_eos=True)))
               for _ in range(args.repeats)]
    return step, statistics.median(prefill)


def decode_after(model, prompt: list[int], tokens: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per decoded token of `tokens` greedy tokens after `prompt`, over `repeats` runs."""
    steps = []
    for _ in range(repeats):
        gen = model.generate(prompt, max_tokens=tokens + 1, ignore_eos=True)
        next(gen)  # the prompt is read and the first token sampled: decode starts here
        t = time.perf_counter()
        n = sum(1 for _ in gen)
        steps.append((time.perf_counter() - t) / n)
    return statistics.median(steps)


LONG_TOKENS = 32  # tokens decoded after the --context prompt


def long_context_prompt(args: argparse.Namespace) -> list[int]:
    return [100 + i % 1000 for i in range(args.context)]  # ids every file's vocabulary holds (gemma4: ~1100)


def batched_beside_one(model, args: argparse.Namespace, one_first: bool) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    """(aggregate tok/s of args.batch streams, seconds a token of one stream, RSS right after the
    batched run) measured back to back, in the order one_first says: the batched figure's ratio to
    one stream, taken per pair, does not carry the drift of a VM whose speed moves by 20% between a
    median of single runs and one of batched runs a minute later. (A one-stream run after the batched
    one may trim the heap, so the RSS is read before it.)"""
    one_s = decode_after(model, DECODE_PROMPT, args.tokens, 1) if one_first else 0.0
    tok_s = batched_decode(model, args.batch, args.tokens)
    after = rss_bytes()
    if not one_first:
        one_s = decode_after(model, DECODE_PROMPT, args.tokens, 1)
    return tok_s, one_s, after


def batched_decode(model, streams: int, tokens: int) -> float:  # type: ignore[no-untyped-def]
    """Aggregate decode tok/s of `streams` sequences stepped together (every prompt read first)."""
    from ember.daemon.engine.sequence import Sequence

    engine = model.engine(streams * (16 + tokens + 1), max_running=streams)
    seqs = [Sequence(list(range(100 + 7 * i, 116 + 7 * i)), tokens + 1) for i in range(streams)]
    for seq in seqs:
        engine.add(seq)
    while any(not seq.generated for seq in seqs):
        engine.step()
    done, t = sum(len(s.generated) for s in seqs), time.perf_counter()
    while engine.has_work:
        engine.step()
    return (sum(len(s.generated) for s in seqs) - done) / (time.perf_counter() - t)


def run_llama_cpp(path: Path, args: argparse.Namespace) -> dict[str, float]:
    from llama_cpp import Llama

    def open_llama(n_ctx: int = args.prompt_tokens + 64, n_batch: int = args.prompt_tokens) -> Llama:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_threads=args.threads,
                     n_threads_batch=args.threads, verbose=False)

    first = open_llama()
    warm_up(lambda prompt, max_tokens, ignore_eos: _llama_generate(first, prompt, max_tokens), args)
    first.close()  # frees its model, context and buffers
    gc.collect()
    rss0 = rss_bytes()
    t = time.perf_counter()
    llm = open_llama()
    load_s = time.perf_counter() - t
    prompt, long_prompt = DECODE_PROMPT, list(range(100, 100 + args.prompt_tokens))
    step_s = _llama_decode_after(llm, prompt, args.tokens, args.repeats)
    prefill = []
    for _ in range(args.repeats):
        llm.reset()
        prefill.append(_timed(lambda: llm.eval(long_prompt)))
    out = {"load_s": load_s, "rss": rss_bytes() - rss0, "step_s": step_s, "prefill_s": statistics.median(prefill)}
    llm.close()
    if getattr(args, "context", 0):  # a context of its own: its KV cache for that length stays out of the RSS above
        llm = open_llama(args.context + LONG_TOKENS + 64, 512)
        out["long_step_s"] = _llama_decode_after(llm, long_context_prompt(args), LONG_TOKENS, args.repeats)
        llm.close()
    return out


def _llama_decode_after(llm, prompt: list[int], tokens: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """decode_after for llama.cpp (a first run warms up)."""
    steps = []
    for _ in range(repeats + 1):
        gen = llm.generate(prompt, top_k=1, temp=0.0, reset=True)
        next(gen)
        t = time.perf_counter()
        for _ in range(tokens):
            next(gen)
        steps.append((time.perf_counter() - t) / tokens)
    return statistics.median(steps[1:])


def _llama_generate(llm, prompt: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    llm.reset()
    gen = llm.generate(prompt, top_k=1, temp=0.0, reset=True)
    return [next(gen) for _ in range(max_tokens)]


def measure(engine: str, path: Path, args: argparse.Namespace) -> dict[str, float]:
    return run_worker(__file__, engine, path, args, ["--batch", str(args.batch), "--context", str(args.context),
                                                   "--kv-dtype", args.kv_dtype, "--prompt-act", args.prompt_act])


def run_worker(script: str, engine: str, path: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    """One engine's figures from `script --worker` in a fresh process (the JSON of its last line)."""
    cmd = [sys.executable, script, "--worker", engine, str(path), "--tokens", str(args.tokens), "--repeats",
           str(args.repeats), "--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} on {path.name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="sequences of ember's batched decode figure")
    ap.add_argument("--context", type=int, default=1536,
                    help=f"prompt tokens before a second decode figure ({LONG_TOKENS} tokens; 0: none)")
    # ember.kernels.convert.KV_DTYPES, written out: importing ember.kernels loads numba in the llama.cpp worker too
    ap.add_argument("--kv-dtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"],
                    help="ember's KV cache (default f16, as ember's and llama.cpp's defaults)")
    ap.add_argument("--prompt-act", default="", choices=["", "f32", "q8_0"],
                    help="ember's prompt activations against quantized weights (default: ember's for this CPU, "
                         "q8_0 with AVX-512 VNNI, else f32; llama.cpp's are int8)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="engines alternated this many times per file, medians reported (this VM drifts 10-20%%)")
    ap.add_argument("--files", nargs="+", default=["demo", "Q8_0", "Q4_K_M", "gemma4"],
                    choices=["demo", "gemma4", *LLAMA_FTYPES])
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        engine, path = args.worker
        print(json.dumps((run_ember if engine == "ember" else run_llama_cpp)(Path(path), args)))
        return
    bandwidth = memory_bandwidth(args.threads)
    print(f"machine: {os.cpu_count()} cpus, threads={args.threads}, measured read bandwidth {bandwidth:.1f} GB/s; "
          f"decode {args.tokens} tokens after 16, prefill {args.prompt_tokens}; medians of {args.rounds} alternating "
          f"rounds of {args.repeats} runs; KV cache ember {args.kv_dtype}, llama.cpp f16")
    print(f"{'file':16} {'engine':9} {'MB':>6} {'load s':>7} {'RSS/file':>8} {'decode tok/s':>12} {'GB/s':>5} "
          f"{'of bw':>5} {'prefill tok/s':>13}")
    for name in args.files:
        path = (demo_file() if name == "demo" else gemma4_file(args.threads) if name == "gemma4"
                else quantized_by_llama_cpp(name, args.threads))
        size, per_token = path.stat().st_size, bytes_per_token(path)
        rounds = [{engine: measure(engine, path, args) for engine in ("ember", "llama.cpp")} for _ in range(args.rounds)]
        results = {engine: {key: statistics.median(r[engine][key] for r in rounds) for key in rounds[0][engine]}
                   for engine in ("ember", "llama.cpp")}
        label = {"demo": "demo Q8_0", "gemma4": "gemma4 Q4_K_M"}.get(name, f"100M {name}")
        for engine, r in results.items():
            gbs = per_token / r["step_s"] / 1e9
            print(f"{label:16} {engine:9} {size / 1e6:6.1f} {r['load_s']:7.2f} {r['rss'] / size:8.2f} "
                  f"{1 / r['step_s']:12.1f} {gbs:5.1f} {gbs / bandwidth:5.0%} {args.prompt_tokens / r['prefill_s']:13.1f}")
        e, ll = results["ember"], results["llama.cpp"]
        batched = (f"; ember {args.batch} streams batched: {e['batch_tok_s']:.0f} tok/s = "
                   f"{e['batch_x']:.2f}x one stream run beside it ({e['batch_tok_s'] * e['step_s']:.2f}x the "
                   f"decode figure; its KV cache and buffers: RSS +{e['batch_rss'] / 1e6:.1f} MB)") if args.batch else ""
        print(f"{label:16} ratio ember/llama.cpp: decode {ll['step_s'] / e['step_s']:.2f}x, "
              f"prefill {ll['prefill_s'] / e['prefill_s']:.2f}x{batched}; its tokenizer's BPE, built by the first "
              f"text encode: RSS +{e['bpe_rss'] / 1e6:.1f} MB")
        if args.context:
            print(f"{label:16} decode after a {args.context}-token prompt: ember {1 / e['long_step_s']:.1f} tok/s, "
                  f"llama.cpp {1 / ll['long_step_s']:.1f} tok/s, ratio {ll['long_step_s'] / e['long_step_s']:.2f}x")


if __name__ == "__main__":
    main()
