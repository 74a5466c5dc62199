"""Greedy decoding under a grammar, in process (`ember.load`): time per token free, under a grammar with
every mask computed, and under it with the argmax tried first (daemon/runner/row_sampler.py), in
alternating rounds in one process (these VMs drift by 10% within a minute), medians and ratios to free.

Grammars: a regex admitting any text (the mechanism's own cost: the same tokens as free) and a JSON
schema of 24 records (a real grammar's masks; its own tokens). Three prompts of `--tokens` tokens each
(ignore_eos; the schema's answers end where it is complete).

    python benchmarks/grammar_decode.py [--model PATH] [--tokens 400] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import ember
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.runner import row_sampler
from ember.protocol.messages import Grammar

RECORDS = {"type": "array", "minItems": 24, "maxItems": 24,
           "items": {"type": "object", "additionalProperties": False, "required": ["name", "value"],
                     "properties": {"name": {"type": "string", "minLength": 4, "maxLength": 12},
                                    "value": {"type": "integer", "minimum": 0, "maximum": 9999}}}}
GRAMMARS = {"any text": Grammar("regex", r"(.|\n)*"), "JSON schema": Grammar("json_schema", json.dumps(RECORDS))}
PROMPTS = ["items = ", "data:", "x = ["]


def per_token(model: ember.Model, grammar: Grammar | None, tokens: int) -> float:
    t0, n = time.perf_counter(), 0
    for prompt in PROMPTS:
        n += len(list(model.generate(prompt, max_tokens=tokens, grammar=grammar, ignore_eos=True)))
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = ember.load(args.model)
    argmax_first = row_sampler.RowSampler._grammar_argmax
    per_token(model, GRAMMARS["JSON schema"], 8)  # warm: llguidance's vocabulary is built on first use
    times: dict[str, list[float]] = {"free": []}
    for _ in range(args.rounds):
        times["free"].append(per_token(model, None, args.tokens))
        for name, grammar in GRAMMARS.items():
            for mode, fast in (("every mask", lambda self, *a: {}), ("argmax first", argmax_first)):
                row_sampler.RowSampler._grammar_argmax = fast  # type: ignore[method-assign]
                times.setdefault(f"{name}, {mode}", []).append(per_token(model, grammar, args.tokens))
    row_sampler.RowSampler._grammar_argmax = argmax_first  # type: ignore[method-assign]
    free = statistics.median(times["free"])
    print(f"greedy, {args.tokens} tokens x {len(PROMPTS)} prompts, medians of {args.rounds} alternating rounds")
    print("| decoding | us per token | / free |\n|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.0f} | {statistics.median(values) / free:.3f} |")


if __name__ == "__main__":
    main()
