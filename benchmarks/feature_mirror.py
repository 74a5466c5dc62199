"""The feature mirror's dtype against the feature draft's acceptance: the trained demo pair (daemon/assets:
the dense model and its DFlash draft), greedy, the same prompts and tokens at each mirror dtype (f32,
f16, bf16, q8_0: EMBER_FEATURE_DTYPE's choices). A DFlash draft reads the target's hidden states back
from the mirror, so a narrower mirror can only cost acceptance; the table says how much, and what a
context position costs in mirror bytes. Acceptance is a count, so the figures do not depend on the
machine's load.

    python benchmarks/feature_mirror.py [--tokens 128] [--draft-tokens 7] [--draft PATH]
"""
from __future__ import annotations

import argparse

import ember
from ember.daemon.loader.demo_model import DEMO_DFLASH, DEMO_MODEL
from ember.daemon.loader.model_file import open_model_file
from ember.daemon.loader.dflash_file import read_dflash
from ember.daemon.speculative.spec_stats import SpecStats
from ember.kernels.convert import STORAGE_DTYPES, storage_bytes

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
           "for i in range(10):\n    print("]


def greedy_stats(model: ember.Model, tokens: int) -> tuple[SpecStats, list[list[int]]]:
    """The spec stats of greedy decoding of every prompt, and the tokens generated."""
    outputs = [list(model.generate(p, max_tokens=tokens, ignore_eos=True)) for p in PROMPTS]
    return model.spec_stats(), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per prompt")
    ap.add_argument("--draft-tokens", type=int, default=7, help="proposals per step (at most block - 1)")
    ap.add_argument("--draft", default=str(DEMO_DFLASH), help="a DFlash draft GGUF for the demo model")
    args = ap.parse_args()
    draft = open_model_file(args.draft)
    width = len(read_dflash(draft).target_layers) * ember.load(DEMO_MODEL).config.hidden
    print(f"demo dense (Q8_0) + {draft.path.name}, greedy, {args.tokens} tokens x {len(PROMPTS)} prompts, "
          f"{args.draft_tokens} proposals a step; mirror row: {width} values")
    print("| mirror dtype | acceptance | mean accepted length | mirror bytes per token | tokens |\n"
          "|---|---|---|---|---|")
    _, reference = greedy_stats(ember.load(DEMO_MODEL), args.tokens)  # autoregressive decoding's tokens
    for dtype in STORAGE_DTYPES:
        model = ember.load(DEMO_MODEL, draft=args.draft, draft_tokens=args.draft_tokens, feature_dtype=dtype)
        stats, outputs = greedy_stats(model, args.tokens)
        same = "as without a draft" if outputs == reference else "DIFFER"  # greedy speculation keeps them
        print(f"| {dtype} | {stats.acceptance_rate:.1%} | {stats.mean_accepted_length:.2f} | "
              f"{storage_bytes(dtype, width)} | {same} |")


if __name__ == "__main__":
    main()
