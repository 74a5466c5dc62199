"""How much the demo model's completions loop under a sampling setting: the share of each completion's
4-grams (of tokens) that repeat an earlier one, over 4 code prompts x 6 seeds x 128 tokens. 0 is no
loop; the greedy "fibonacci(fibonacci(..." completion is ~0.9. The demo file's own recommendation
(daemon/assets/README.md) was chosen with it.

    python benchmarks/demo_sampling.py [--temperature T --top-k K --top-p P --min-p M --repetition-penalty R]
"""
from __future__ import annotations

import argparse

import numpy as np

import ember
from ember.daemon.loader.demo_model import DEMO_MODEL

PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n", "def read_config(path):")


def repeated_share(ids: list[int], n: int = 4) -> float:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / max(1, len(grams))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("temperature", None), ("top-k", None), ("top-p", None), ("min-p", None),
                          ("repetition-penalty", None)):
        p.add_argument(f"--{name}", type=float, default=default, help="default: the demo file's recommendation")
    args = p.parse_args()
    model = ember.load(DEMO_MODEL)
    given = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")}
    sampling = model.sampling.filled(**given)
    sampling["top_k"] = int(sampling["top_k"])
    shares = [repeated_share(list(model.generate(prompt, max_tokens=128, seed=seed, **sampling)))
              for prompt in PROMPTS for seed in range(6)]
    print(f"{sampling}: repeated 4-grams mean {np.mean(shares):.3f}, worst {np.max(shares):.3f} "
          f"({len(shares)} completions)")


if __name__ == "__main__":
    main()
