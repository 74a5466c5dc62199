"""Calibration of the memory planner's activation reservation against measured peaks.

For each model shape (random-weight Q8_0 GGUF files cached under benchmarks/.cache, plus the demo
model) and each step shape — T tokens per step (the prefill chunk) from S sequences: S - 1 decode
tokens and one prompt chunk of T - S + 1 tokens, S rows of logits sampled with top-p, the largest step
the scheduler builds — a fresh process runs that step through the model (Transformer.forward, then
sampling, as BatchEngine does) and measures the transient peak above the resident weights and KV
cache, two ways:
  rss     VmHWM after a reset (/proc/self/clear_refs <- 5) minus VmRSS before; glibc is told to
          mmap every block over 64 KiB (MALLOC_MMAP_THRESHOLD_) so a freed array leaves RSS at once,
          and numba's own scratch (not seen by tracemalloc) is included
  traced  tracemalloc's peak minus its current before (numpy's allocations)
measured = the larger, over 3 runs after 2 warm-up runs (compilation, first touch of weights and KV).
Printed: planned (daemon/planning/planner.py) / measured, and the safety factor each shape implies,
measured / (widest x T x 4): the factor that alone would cover the peak (meaningful where the layers'
buffers, not the logits, make it).

CPU only: ember has no CUDA backend yet. With one, the same steps would be measured through
cupy.get_default_memory_pool().get_total_bytes() peaks (see docs/planner.md).

    python benchmarks/planner_calibration.py [--quick] [--json FILE]
    python benchmarks/planner_calibration.py --gemma4

--gemma4 measures a whole footprint instead: a Gemma 4 shape (GEMMA4_SHAPE) loaded, its KV cache for
one sequence of 4k, 32k and 128k positions sized as the engine sizes it (sliding layers in window
rings) with every page written, and the peak of the step over the last prefill chunk, against
ember plan's weights + KV cache + activations.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
RUNS, WARMUP = 3, 2


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int = 2  # a step's transient peak does not grow with depth: each layer frees its temporaries


SHAPES = [
    Shape("llama-d1024", "llama", 1024, 2816, 16, 4, 64, 32000),
    Shape("qwen3-0.6b-like", "qwen3", 1024, 3072, 16, 8, 128, 151936),  # q width 2048 > hidden; big vocab
    Shape("qwen2.5-ratio", "llama", 896, 4864, 14, 2, 64, 32000),  # hidden/ffn 0.18, as Qwen2.5 0.5B-32B
    Shape("wide-ffn", "llama", 512, 4096, 8, 2, 64, 32000),  # hidden/ffn 0.125
    Shape("llama-d2048", "llama", 2048, 5632, 16, 4, 128, 32000),
]
STEPS = [(64, 1), (256, 1), (256, 8), (256, 32), (512, 1), (512, 4)]
QUICK_STEPS = [(64, 1), (256, 1), (256, 8)]


def model_file(shape: Shape) -> Path:
    path = CACHE / f"calib-{shape.name}.gguf"
    if path.exists():
        return path
    import gguf

    CACHE.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), shape.arch)
    for key, value in {"block_count": shape.layers, "context_length": 4096, "embedding_length": shape.hidden,
                       "feed_forward_length": shape.ffn, "attention.head_count": shape.heads,
                       "attention.head_count_kv": shape.kv_heads, "attention.key_length": shape.head_dim,
                       "attention.value_length": shape.head_dim, "vocab_size": shape.vocab}.items():
        w.add_uint32(f"{shape.arch}.{key}", value)
    w.add_float32(f"{shape.arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{shape.arch}.attention.layer_norm_rms_epsilon", 1e-6)
    q, kv, d, f = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.ffn
    tensors = {"token_embd.weight": (shape.vocab, d), "output_norm.weight": (d,), "output.weight": (shape.vocab, d)}
    for i in range(shape.layers):
        p = f"blk.{i}."
        tensors |= {p + "attn_norm.weight": (d,), p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d),
                    p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, q), p + "ffn_norm.weight": (d,),
                    p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f)}
        if shape.arch == "qwen3":
            tensors |= {p + "attn_q_norm.weight": (shape.head_dim,), p + "attn_k_norm.weight": (shape.head_dim,)}
    for name, dims in tensors.items():
        if len(dims) == 1:
            w.add_tensor(name, np.ones(dims, np.float32))
        else:
            values = (rng.standard_normal(dims, dtype=np.float32) * 0.02)
            raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- the measured child -------------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def measure_step(path: str, tokens: int, seqs: int) -> dict[str, int]:
    """Peak bytes above the resident model and KV cache while one step of `tokens` tokens from `seqs`
    sequences runs (forward + sampling). Runs in this process: call it in a fresh one."""
    from ember.daemon.loader.model_file import open_model_file
    from ember.daemon.models.transformer import Transformer
    from ember.daemon.step.step_batch import StepBatch
    from ember.kernels import get_ops
    from ember.kernels.sampling import SamplingParams
    from ember.kernels.sampling_batch import sample

    net = Transformer(open_model_file(path), get_ops("cpu"))
    block, decode_pos = 16, 64
    prompt = tokens - (seqs - 1)
    per_seq = -(-max(prompt, decode_pos + 1) // block)
    cache = net.new_cache(per_seq * seqs, block, "f32")
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(seqs)]
    chunks = [([1], decode_pos, tables[s]) for s in range(seqs - 1)]
    chunks.append((list(np.arange(prompt) % 1000 + 1), 0, tables[-1]))
    batch = StepBatch.build(chunks, block)
    params, rng = SamplingParams(temperature=0.8, top_p=0.9), np.random.default_rng(0)

    def step() -> None:
        logits = net.ops.to_numpy(net.forward(batch, cache))
        for row in logits:
            sample(row, params, rng, [1, 2, 3], [])

    for _ in range(WARMUP):
        step()
    gc.collect()
    rss = 0
    for _ in range(RUNS):
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        step()
        rss = max(rss, _status("VmHWM") - before)
    tracemalloc.start()
    step()  # tracemalloc's own bookkeeping settles
    traced = 0
    for _ in range(RUNS):
        tracemalloc.reset_peak()
        current = tracemalloc.get_traced_memory()[0]
        step()
        traced = max(traced, tracemalloc.get_traced_memory()[1] - current)
    tracemalloc.stop()
    return {"rss": rss, "traced": traced}


def run_child(path: Path, tokens: int, seqs: int) -> dict[str, int]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, __file__, "--child", str(path), str(tokens), str(seqs)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"measuring {path.name} T={tokens} S={seqs} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- a Gemma 4 shape's whole footprint at long contexts -------------------------------------------
# Gemma 4's small-model layout (E2B's: per-layer embeddings, the last layers sharing K/V with a
# double-wide FFN, values from keys on full layers) at ~30M parameters, its context 131072, sliding
# layers over 1024 positions (31B's window)
GEMMA4_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, global_head_dim=128, num_global_key_value_heads=2,
                    attention_k_eq_v=True, sliding_window=1024, hidden_size_per_layer_input=64,
                    vocab_size_per_layer_input=8192, num_kv_shared_layers=2, use_double_wide_mlp=True,
                    final_logit_softcapping=30.0, vocab_size=8192, max_position_embeddings=131072,
                    tie_word_embeddings=True)
GEMMA4_CONTEXTS = (4096, 32768, 131072)


def gemma4_dir() -> Path:
    """The shape's random weights (transformers' init), an F32 Hugging Face directory, cached."""
    path = CACHE / "gemma4-e2b-shape-f32"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    Gemma4ForCausalLM(Gemma4TextConfig(**GEMMA4_SHAPE)).eval().save_pretrained(path)
    return path


def measure_footprint(path: str, ctx: int, chunk: int) -> dict[str, int]:
    """Bytes this process gains loading the model, allocating a cache for one sequence of `ctx`
    positions as the engine sizes it (its pages written: a full cache; the embedding tables' every
    row read, as a long context reads rows of any token) and running the step of its last `chunk`
    positions (forward + sampling), at that step's peak: the memory ember plan counts.
    The same work runs first on another instance of the model, freed since, so that the figure is the
    model's and not the code and runtime the process brings in on first use (as cpu_decode.py's RSS)."""
    from ember.daemon.loader.model_file import open_model_file
    from ember.daemon.models.transformer import Transformer
    from ember.daemon.planning.precision import DeviceCaps, resolve_policy
    from ember.daemon.step.step_batch import StepBatch
    from ember.kernels import get_ops
    from ember.kernels.sampling import SamplingParams
    from ember.kernels.sampling_batch import sample

    block, kv, ops = 16, resolve_policy([DeviceCaps.of("cpu")]).kv, get_ops("cpu")
    params, rng = SamplingParams(temperature=0.8, top_p=0.9), np.random.default_rng(0)

    def run(peak: bool) -> dict[str, int]:
        start = _status("VmRSS")
        net = Transformer(open_model_file(path), ops)
        cache = net.new_cache(-(-ctx // block), block, kv, max_sequences=1, step_tokens=chunk)
        for store in (*cache.k, *cache.v):  # every page written, as a full context leaves them
            for a in vars(store).values():
                if isinstance(a, np.ndarray) and a.flags.writeable:
                    a.fill(0)
        for table in (net.embed, net.per_layer.table if net.per_layer else None):  # every row read: a long
            if table is not None:  # context reads rows of any token; one step reads its own alone
                float((table.f32 if table.f32 is not None else table.u8).sum())
        batch = StepBatch.build([(list(np.arange(chunk) % 1000 + 1), ctx - chunk, list(range(cache.n_blocks)))],
                                block, state_slots=[0])
        if peak:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        for row in net.ops.to_numpy(net.forward(batch, cache)):
            sample(row, params, rng, [1, 2, 3], [])
        return {"peak": _status("VmHWM") - start, "kv": sum(cache.layer_bytes)}

    run(False)  # the code and runtime a first step brings in
    gc.collect()
    return run(True)


def gemma4_rows(chunk: int = 256) -> list[dict[str, float]]:
    """Planned (ember plan: weights, KV cache, activations on the CPU) against measured, per context."""
    from ember.daemon.planning.planner import GiB, Device, PlanRequest, plan_model

    path, rows = gemma4_dir(), []
    print(f"{'gemma4 E2B shape':<18} {'ctx':>7} {'planned':>13} {'measured':>13} {'plan/meas':>9} "
          f"{'KV planned':>12} {'KV held':>12}")
    for ctx in GEMMA4_CONTEXTS:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        out = subprocess.run([sys.executable, __file__, "--gemma4-child", str(path), str(ctx), str(chunk)],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"measuring gemma4 at ctx {ctx} failed:\n{out.stderr}")
        m = json.loads(out.stdout.strip().splitlines()[-1])
        d = plan_model(path, PlanRequest.create([Device("cpu", 64 * GiB)], env={}, ctx=ctx, seqs=1,
                                                prefill_chunk=chunk)).devices[0]
        plan = d.weights.total + d.kv_cache + d.activations.bytes
        rows.append(dict(model="gemma4", ctx=ctx, planned=plan, measured=m["peak"], ratio=plan / m["peak"],
                         kv_planned=d.kv_cache, kv_held=m["kv"]))
        print(f"{'gemma4 E2B shape':<18} {ctx:>7} {plan:>13,} {m['peak']:>13,} {plan / m['peak']:>9.3f} "
              f"{d.kv_cache:>12,} {m['kv']:>12,}", flush=True)
    return rows


# --- planned vs measured ------------------------------------------------------------------------
def planned(path: Path, tokens: int, seqs: int) -> tuple[int, dict[str, float]]:
    from ember.daemon.planning.planner import GiB, Device, PlanRequest, plan_model

    request = PlanRequest.create([Device("cpu", 64 * GiB)], env={}, ctx=4096, seqs=seqs, prefill_chunk=tokens)
    a = plan_model(path, request).devices[0].activations
    return a.bytes, {"widest": a.widest}


def main() -> int:
    from ember.daemon.loader.demo_model import DEMO_MODEL

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the demo model and one synthetic shape, 3 steps")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--gemma4", action="store_true",
                        help="only the Gemma 4 shape's whole footprint at 4k, 32k and 128k context")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--gemma4-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_step(args.child[0], int(args.child[1]), int(args.child[2]))))
        return 0
    if args.gemma4_child:
        print(json.dumps(measure_footprint(args.gemma4_child[0], int(args.gemma4_child[1]), int(args.gemma4_child[2]))))
        return 0
    if args.gemma4:
        ratios = [r["ratio"] for r in gemma4_rows()]
        print(f"planned/measured: min {min(ratios):.3f}, max {max(ratios):.3f}")
        return 0 if min(ratios) >= 1.0 else 1
    models = [("demo (qwen3 d384)", Path(DEMO_MODEL))] + [(s.name, model_file(s)) for s in SHAPES[: 1 if args.quick else None]]
    rows = []
    print(f"{'model':<18} {'T':>4} {'S':>3} {'planned':>12} {'rss':>12} {'traced':>12} {'plan/meas':>9} {'implied':>8}")
    for label, path in models:
        for tokens, seqs in QUICK_STEPS if args.quick else STEPS:
            m = run_child(path, tokens, seqs)
            plan, parts = planned(path, tokens, seqs)
            measured = max(m["rss"], m["traced"])
            implied = measured / (parts["widest"] * tokens * 4)
            rows.append(dict(model=label, tokens=tokens, seqs=seqs, planned=plan, measured=measured, **m,
                             ratio=plan / measured, implied_safety=implied))
            print(f"{label:<18} {tokens:>4} {seqs:>3} {plan:>12,} {m['rss']:>12,} {m['traced']:>12,} "
                  f"{plan / measured:>9.3f} {implied:>8.3f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    within = sum(1.0 <= r <= 1.10 for r in ratios)
    layer_bound = [r["implied_safety"] for r in rows if r["seqs"] == 1 and r["tokens"] >= 256]
    print(f"planned/measured: min {min(ratios):.3f}, max {max(ratios):.3f}; {within} of {len(rows)} within "
          f"1.00-1.10; implied safety where the layers make the peak: {min(layer_bound):.3f}-{max(layer_bound):.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if min(ratios) >= 1.0 else 1  # never under is the hard requirement

if __name__ == "__main__":
    sys.exit(main())
