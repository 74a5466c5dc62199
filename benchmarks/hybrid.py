"""Hybrid models (qwen35: Gated DeltaNet + gated attention) on the CPU, ember vs llama.cpp on one file.

The file: a random-weight scaled Qwen3.5 shape (hidden 768, 12 layers = 9 Gated DeltaNet + 3 gated
attention, 8 key/value heads of 128 x 128 state, attention 6 heads on 2 KV heads of head_dim 256 with
64 rotary dimensions, FFN 2048, vocab 32768 with the demo tokenizer padded, tied embeddings; ~130M
parameters), built with transformers, converted by llama.cpp's own convert_hf_to_gguf.py and quantized
to Q8_0 by llama.cpp's llama_model_quantize (cached under benchmarks/.cache; needs the llama.cpp
sources, EMBER_LLAMA_CPP_SRC, see tests/llama_cpp_tools.py).

Figures, each engine in a fresh process, the two run one after the other in this run:
- decode tok/s: a greedy loop of --tokens tokens after a 16-token prompt (median of --repeats);
- prefill tok/s of a --prompt-tokens prompt (ember: the chunked delta rule, 256-token steps);
- ember's prefill read token by token instead (--recurrent-tokens of the prompt, one token a step: the
  delta rule's recurrence, as a model without the chunked form would read a prompt);
- the delta rule alone at this shape on --prompt-tokens tokens: one chunked call vs the recurrence
  (one call per token), same kernel, same state.

    python benchmarks/hybrid.py [--tokens 64] [--repeats 3] [--prompt-tokens 2048] [--recurrent-tokens 256] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # tiny_models (the HF builder) and llama_cpp_tools (converter, quantizer)
sys.path.insert(0, str(HERE))

import cpu_decode  # noqa: E402
from cpu_decode import _timed  # noqa: E402

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=6,
             num_key_value_heads=2, head_dim=256, vocab_size=32768, max_position_embeddings=4096,
             linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, tie_word_embeddings=True)


def hybrid_file() -> Path:
    path = HERE / ".cache" / "qwen35-130m-q8_0.gguf"
    if path.exists():
        return path
    from llama_cpp_tools import convert, quantize
    from tiny_models import build_hf_model

    path.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, _ = build_hf_model("qwen35", Path(tmp) / "hf", **SHAPE)
        quantize(convert(hf_dir, Path(tmp) / "f16.gguf", "f16"), path)
    return path


def run_ember(path: Path, args: argparse.Namespace) -> dict[str, float]:
    import numba

    import ember
    from ember.daemon.engine.sequence import Sequence

    numba.set_num_threads(args.threads)
    model = ember.load(path)
    step_s, prefill_s = cpu_decode.decode_and_prefill(model, args)  # the dense benchmark's decode and prefill
    long_prompt = list(range(100, 100 + args.prompt_tokens))
    engine = model.engine(args.recurrent_tokens + 1, max_step_tokens=1)  # one prompt token a step
    engine.add(Sequence(long_prompt[: args.recurrent_tokens], 1))
    t = time.perf_counter()
    while engine.has_work:
        engine.step()
    recurrent = time.perf_counter() - t
    return {"step_s": step_s, "prefill_tok_s": args.prompt_tokens / prefill_s,
            "recurrent_prefill_tok_s": args.recurrent_tokens / recurrent, **delta_rule_alone(model, args)}


def delta_rule_alone(model, args: argparse.Namespace) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The first linear layer's delta rule over the prompt: chunked (one call) vs recurrent (a call a token)."""
    lin, ops = model.config.linear, model.net.ops
    rng = np.random.default_rng(0)
    n = args.prompt_tokens
    qkv = rng.standard_normal((n, lin.conv_channels)).astype(np.float32)
    a, b = (rng.standard_normal((n, lin.v_heads)).astype(np.float32) for _ in range(2))
    layer = model.net.blocks[0].attn
    state = ops.zeros((1, lin.v_heads, lin.k_dim, lin.v_dim))
    slot, positions = np.zeros(1, np.int64), np.arange(n, dtype=np.int64)

    def chunked() -> None:
        ops.gated_delta_net(qkv, a, b, layer.A, layer.dt_bias, state, np.array([0, n]), slot, positions,
                            lin.k_heads, lin.k_dim, layer.tiled)

    def recurrent() -> None:
        one = np.array([0, 1])
        for t in range(n):
            ops.gated_delta_net(qkv[t: t + 1], a[t: t + 1], b[t: t + 1], layer.A, layer.dt_bias, state, one, slot,
                                positions[t: t + 1], lin.k_heads, lin.k_dim, layer.tiled)

    chunked(), recurrent()  # warm up
    return {"delta_chunked_s": min(_timed(chunked) for _ in range(args.repeats)),
            "delta_recurrent_s": min(_timed(recurrent) for _ in range(args.repeats))}


def run_llama_cpp(path: Path, args: argparse.Namespace) -> dict[str, float]:
    r = cpu_decode.run_llama_cpp(path, args)  # the same decode loop and prompt as the dense benchmark
    return {"step_s": r["step_s"], "prefill_tok_s": args.prompt_tokens / r["prefill_s"]}


def measure(engine: str, path: Path, args: argparse.Namespace) -> dict[str, float]:
    return cpu_decode.run_worker(__file__, engine, path, args, ["--recurrent-tokens", str(args.recurrent_tokens)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--recurrent-tokens", type=int, default=256)
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        engine, path = args.worker
        print(json.dumps((run_ember if engine == "ember" else run_llama_cpp)(Path(path), args)))
        return
    path = hybrid_file()
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), threads={args.threads}: decode {args.tokens} tokens "
          f"after 16, prefill {args.prompt_tokens}; medians of {args.repeats}")
    e, ll = measure("ember", path, args), measure("llama.cpp", path, args)
    print(f"{'engine':10} {'decode tok/s':>12} {'prefill tok/s':>13}")
    for name, r in (("ember", e), ("llama.cpp", ll)):
        print(f"{name:10} {1 / r['step_s']:12.1f} {r['prefill_tok_s']:13.1f}")
    print(f"ratio ember/llama.cpp: decode {ll['step_s'] / e['step_s']:.2f}x, prefill "
          f"{e['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x")
    print(f"ember prefill, chunked {e['prefill_tok_s']:.1f} tok/s vs token by token (the recurrence, "
          f"{args.recurrent_tokens} tokens) {e['recurrent_prefill_tok_s']:.1f} tok/s: "
          f"{e['prefill_tok_s'] / e['recurrent_prefill_tok_s']:.1f}x")
    print(f"delta rule alone, {args.prompt_tokens} tokens, one layer: chunked {e['delta_chunked_s'] * 1e3:.0f} ms, "
          f"recurrent {e['delta_recurrent_s'] * 1e3:.0f} ms: {e['delta_recurrent_s'] / e['delta_chunked_s']:.1f}x")


if __name__ == "__main__":
    main()
