"""MoE decode speed with hot and cold experts, ember vs llama.cpp (llama-cpp-python) on the same GGUF files.

Files:
- the trained MoE demo model (tests/fixtures/ember-demo-moe-q8_0.gguf: qwen3moe, 6 layers, hidden 256,
  16 experts, top-2; its routing is skewed);
- a random-weight file with Qwen3-30B-A3B's layer structure scaled to fit this box (qwen3moe: 128
  experts, top-8, norm_topk_prob, 32 query heads on 4 KV heads of 128, untied output; hidden 2048 ->
  512, expert FFN 768 -> 192, 48 -> 8 layers, vocab 8192: about 330 MB in Q8_0, written by
  tests/gguf_writer.py);
- a random-weight file with Laguna XS.2's layer structure, scaled the same way (laguna: a dense lead
  layer, then 256 experts of 512 -> 256, top-8, with a shared expert, sigmoid routing; full attention
  on every 4th layer from 0 with 48 -> 12 query heads, a window of 512 with 64 -> 16 on the rest, 8 -> 2
  KV heads of 128, partial rotary on the full layers; hidden 2048 -> 512, 40 -> 8 layers, vocab
  100352 -> 8192), made by transformers' LagunaForCausalLM, converted by llama.cpp's own converter
  and quantized by its quantizer to Q4_K_M (about 430 MB; needs the oracle extra and the converter,
  tests/llama_cpp_tools.py).
The random files are cached under benchmarks/.cache; their random routers route about uniformly.

For each file, one round runs each configuration in turn on the same prompt, --rounds rounds, and
reports the median decode tok/s of --tokens tokens after a 32-token prompt (greedy on the trained
model; sampled at temperature 1 on the random ones, whose greedy loop would repeat one token):
  all hot     every expert computed by the engine (ember's default)
  B exact     the file's budget B of the experts' bytes hot (50%; 60% on the Laguna file, the seed's
              figure), placed by the routing statistics the all-hot runs left in the cache, the rest
              computed exactly by --workers cold-expert worker processes
  B mask      the same placement, cold experts dropped (cold_policy "mask": lossy)
  llama.cpp   the same file, --threads threads
It also says how skewed the routing was (the share of routed (token, expert) slots that went to each
layer's top quarter of experts: 25% is uniform), the share of slots computed cold, and how much of the
cold work overlapped the hot work (1 - engine wait / worker compute time).

    python benchmarks/moe.py [--tokens 64] [--rounds 3] [--threads N] [--workers 2] [--only trained|random|laguna]

--threads (default: one per core but one, as the daemon serves) is the engine's kernel threads and
llama.cpp's threads; each cold worker runs one kernel thread.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the GGUF writer the oracle tests use, llama.cpp's tools
os.environ.setdefault("EMBER_CACHE_DIR", str(HERE / ".cache" / "ember"))  # routing statistics of these runs

TRAINED = REPO / "tests" / "fixtures" / "ember-demo-moe-q8_0.gguf"
# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads on 4 KV heads of 128, 128 experts of 768, top-8
RANDOM_SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    intermediate_size=1536, moe_intermediate_size=192, num_experts=128, num_experts_per_tok=8,
                    norm_topk_prob=True, vocab_size=8192, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
# Laguna XS.2: hidden 2048, 40 layers (the first dense), 48 query heads on full layers and 64 on sliding
# ones, 8 KV heads of 128, 256 experts of 512 and a shared one of 512, top-8, window 512
LAGUNA_LAYERS = 8
LAGUNA_SHAPE = dict(hidden_size=512, num_hidden_layers=LAGUNA_LAYERS, intermediate_size=2048, num_attention_heads=12,
                    num_key_value_heads=2, head_dim=128, num_experts=256, num_experts_per_tok=8,
                    moe_intermediate_size=256, shared_expert_intermediate_size=256, sliding_window=512,
                    layer_types=["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(LAGUNA_LAYERS)],
                    num_attention_heads_per_layer=[12 if i % 4 == 0 else 16 for i in range(LAGUNA_LAYERS)],
                    moe_routed_scaling_factor=2.5, vocab_size=8192, max_position_embeddings=4096, bos_token_id=0,
                    eos_token_id=0)
CONFIGS = ("all hot", "exact", "mask", "llama.cpp")


def random_moe_file() -> Path:
    path = HERE / ".cache" / "qwen3moe-30b-a3b-shape-v3-q8_0.gguf"
    if path.exists():
        return path
    from transformers import Qwen3MoeConfig

    from ember.kernels.tensor_types import TensorType
    from gguf_writer import write_gguf

    s, rng = RANDOM_SHAPE, np.random.default_rng(0)
    h, f, hd, e = s["hidden_size"], s["moe_intermediate_size"], s["head_dim"], s["num_experts"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (s["vocab_size"], h), "lm_head.weight": (s["vocab_size"], h),
              "model.norm.weight": (h,)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * f, h),
                   p + "mlp.experts.down_proj": (e, h, f)}
    # token embeddings 50x larger than the rest: with all weights alike, random attention layers (which
    # average values over positions) pull every token's residual toward one shared direction, and the
    # deeper routers then send nearly all tokens to the same few experts; with the embedding dominant the
    # residual stays the token's own and routing stays about uniform, as this file is meant to route
    state = {k: (np.ones(v, np.float32) if len(v) == 1 else
                 rng.standard_normal(v, np.float32) * (1.0 if k == "model.embed_tokens.weight" else 0.02))
             for k, v in shapes.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_gguf(tmp, Qwen3MoeConfig(**s), state, {"*": TensorType.Q8_0})
    tmp.rename(path)
    return path


def laguna_file() -> Path:
    """The Laguna XS.2 shape: transformers' random init (its routers' logits are O(1), as trained ones),
    converted and quantized by llama.cpp."""
    path = HERE / ".cache" / "laguna-xs2-shape-v1-q4_k_m.gguf"
    if path.exists():
        return path
    import shutil

    import torch
    from transformers import LagunaConfig, LagunaForCausalLM

    from llama_cpp_tools import convert, quantize

    work = HERE / ".cache" / "laguna-xs2-shape-work"
    torch.manual_seed(0)
    model = LagunaForCausalLM(LagunaConfig(**LAGUNA_SHAPE)).eval()
    with torch.no_grad():  # token embeddings dominant, as in random_moe_file: routing stays about uniform
        model.model.embed_tokens.weight.mul_(50)
    model.save_pretrained(work / "hf")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "tests" / "fixtures" / "ember-demo-dense" / f, work / "hf" / f)
    f16 = convert(work / "hf", work / "f16.gguf", "f16")
    quantize(f16, path.with_suffix(".tmp"), "Q4_K_M").rename(path)
    shutil.rmtree(work)
    return path


def prompt_ids(model, trained: bool) -> list[int]:
    if trained:  # real Python: the routing the model was trained on
        return model.tokenize((REPO / "daemon" / "experts" / "cold_pool.py").read_text())[:32]
    return np.random.default_rng(1).integers(1, model.config.vocab, 32).tolist()


def decode_rate(tokens) -> float:
    """tok/s of a token iterator after its first token (the prompt's prefill is not timed)."""
    it = iter(tokens)
    next(it)
    start, n = time.perf_counter(), 0
    for _ in it:
        n += 1
    return n / (time.perf_counter() - start)


def sampling(trained: bool) -> dict:
    """Greedy for the trained model (the text it writes); temperature 1 for the random one, whose greedy
    output repeats one token (and so one routing) forever: sampled tokens spread its routing out."""
    return {} if trained else dict(temperature=1.0)


def run_ember(path: Path, ids: list[int], trained: bool, args: argparse.Namespace, **options) -> tuple[float, dict]:
    import ember

    model = ember.load(path, **options)
    try:
        # warm, with the measured sampling: kernels loaded (the sampled steps' kernels are not the greedy
        # bursts'; each loads from the cache at its first call), workers started
        list(model.generate(ids[:4], max_tokens=2, ignore_eos=True, seed=1, **sampling(trained)))
        rate = decode_rate(model.generate(ids, max_tokens=args.tokens, ignore_eos=True, seed=1, **sampling(trained)))
        s = model.expert_stats()
        counts = model.routing_stats()
        info = dict(cold_share=s.cold_share, overlap=s.overlap, cold_busy_s=s.cold_busy_s, cold_wait_s=s.cold_wait_s,
                    top_quarter=top_quarter_share(counts), hot=s.hot_experts, total=s.total_experts)
    finally:
        model.close()  # saves the routing statistics the next placement uses
    return rate, info


def top_quarter_share(counts: np.ndarray) -> float:
    """Mean over MoE layers of the routed slots' share on the layer's most-used quarter of experts."""
    rows = counts[counts.sum(1) > 0].astype(np.float64)
    top = np.sort(rows, axis=1)[:, -max(1, rows.shape[1] // 4):].sum(1)
    return float(np.mean(top / rows.sum(1)))


def run_llama_cpp(path: Path, ids: list[int], trained: bool, args: argparse.Namespace) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=args.threads, seed=1, verbose=False)
    temp = sampling(trained).get("temperature", 0.0)
    try:
        list(_llama_tokens(llm, ids[:4], 2, temp))  # warm
        return decode_rate(_llama_tokens(llm, ids, args.tokens, temp))
    finally:
        llm.close()


def _llama_tokens(llm, ids: list[int], n: int, temp: float):
    top_k = 1 if temp == 0 else 0  # 0: the whole vocabulary
    for i, token in enumerate(llm.generate(ids, top_k=top_k, top_p=1.0, min_p=0.0, temp=temp, reset=True)):
        yield token
        if i + 1 == n:
            return


def bench_file(name: str, path: Path, trained: bool, budget: str, args: argparse.Namespace) -> dict:
    import ember

    ids = prompt_ids(ember.load(path), trained)
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    info: dict[str, dict] = {}
    for _ in range(args.rounds):
        for config in CONFIGS:
            if config == "llama.cpp":
                rates[config].append(run_llama_cpp(path, ids, trained, args))
                continue
            options = {} if config == "all hot" else dict(expert_budget=budget, cold_workers=args.workers,
                                                          cold_policy=config)
            rate, info[config] = run_ember(path, ids, trained, args, **options)
            rates[config].append(rate)
    medians = {c: statistics.median(r) for c, r in rates.items()}
    return dict(file=name, path=str(path), size_mb=round(path.stat().st_size / 1e6, 1), budget=budget,
                routing="skewed" if trained else "uniform",
                top_quarter_share=round(info["all hot"]["top_quarter"], 3),
                tok_s={c: round(v, 1) for c, v in medians.items()},
                vs_llama_cpp={c: round(medians[c] / medians["llama.cpp"], 2) for c in CONFIGS[:3]},
                all_hot_reaches_llama_cpp=medians["all hot"] >= medians["llama.cpp"],
                cold_share={c: round(info[c]["cold_share"], 3) for c in CONFIGS[1:3]},
                hot_experts=f"{info['exact']['hot']}/{info['exact']['total']}",
                cold_overlap=round(info["exact"]["overlap"], 3),
                cold_busy_s=round(info["exact"]["cold_busy_s"], 3),
                cold_wait_s=round(info["exact"]["cold_wait_s"], 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    # the daemon's serving default (daemon/runner/devices.py): one kernel thread per core but one; on a
    # busy 2-core box two-thread kernels stall at their barriers (measured here: 2.7 tok/s with 2
    # threads, 75 with 1, on the random file)
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", choices=("trained", "random", "laguna"))
    args = ap.parse_args()
    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    files = [("trained", lambda: TRAINED, True, "50%"), ("random 30B-A3B shape", random_moe_file, False, "50%"),
             ("laguna XS.2 shape", laguna_file, False, "60%")]
    results = []
    for name, path, trained, budget in files:
        if args.only and not name.startswith(args.only):
            continue
        results.append(bench_file(name, path(), trained, budget, args))
        r = results[-1]
        print(f"\n{r['file']} ({r['size_mb']} MB, routing {r['routing']}: top quarter of experts take "
              f"{r['top_quarter_share']:.0%} of the slots)")
        for c in CONFIGS:
            extra = ""
            if c in r["cold_share"]:
                extra = f"  {r['cold_share'][c]:.0%} of slots cold"
            if c == "exact":
                extra += f", {r['cold_overlap']:.0%} of the cold work overlapped the hot work"
            ratio = f"  ({r['vs_llama_cpp'][c]:.2f}x llama.cpp)" if c in r["vs_llama_cpp"] else ""
            label = c if c in ("all hot", "llama.cpp") else f"{budget} {c}"
            print(f"  {label:<10} {r['tok_s'][c]:>8.1f} tok/s{ratio}{extra}")
        print(f"  all hot reaches llama.cpp: {'yes' if r['all_hot_reaches_llama_cpp'] else 'no'}")
    print(json.dumps(dict(tokens=args.tokens, rounds=args.rounds, threads=args.threads, workers=args.workers,
                          results=results), indent=1))


if __name__ == "__main__":
    main()
