"""Speculative decoding on the CPU: autoregressive vs draft-model decoding of the trained demo pair
(daemon/assets: the dense model and its draft), greedy and at temperature 0.7, in one run.

For each mode, the configurations alternate --rounds times (so the machine's drift hits them alike)
and each figure is the median over the rounds: tok/s of --tokens generated tokens after each of the
prompts (one sequence at a time, ignore_eos, as Model.generate runs), the draft's acceptance rate and
the mean accepted length (tokens per verification pass, the target's own one included). Then what
bounds the speedup, measured on the same models: one target decode step (1 token), one
verification forward (k + 1 tokens), one draft step, and the speedup they predict,
L x t_step / (k x t_draft + t_verify) for mean accepted length L.

    python benchmarks/speculative.py [--tokens 128] [--rounds 3] [--k 2,3,4] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import ember
from ember.daemon.loader.demo_model import DEMO_DRAFT, DEMO_MODEL
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.runner.step_batch import StepBatch
from ember.daemon.speculative.spec_stats import SpecStats

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
           "for i in range(10):\n    print("]
MODES = {"greedy": {}, "t=0.7": {"temperature": 0.7, "seed": 1}}


def decode(model: ember.Model, tokens: int, options: dict) -> tuple[float, SpecStats]:
    """tok/s over the prompts (prefill excluded: timed from the first token on), and the spec stats."""
    before = model.spec_stats()
    elapsed, generated = 0.0, 0
    for prompt in PROMPTS:
        stream = model.generate(prompt, max_tokens=tokens, ignore_eos=True, **options)
        next(stream)  # the prompt's pass and the first token: the same work with or without a draft
        t0 = time.perf_counter()
        generated += sum(1 for _ in stream)
        elapsed += time.perf_counter() - t0
    after = model.spec_stats()
    return generated / elapsed, SpecStats(after.proposed - before.proposed, after.accepted - before.accepted,
                                          after.steps - before.steps)


def forward_ms(net, n: int, context: int = 64, reps: int = 200) -> float:  # type: ignore[no-untyped-def]
    """One forward pass of n generated tokens after `context` positions, in milliseconds (median of 5)."""
    runner = ModelRunner(net, 16, 16)
    table = list(range(16))
    net.forward(runner.prepare(StepBatch.build([(list(range(1, context + 1)), 0, table)], 16, prompt_lengths=[context])),
                runner.cache)
    batch = runner.prepare(StepBatch.build([(list(range(100, 100 + n)), context, table)], 16,
                                           prompt_lengths=[context], logit_tails=[n]))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            net.forward(batch, runner.cache)
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", default="2,3,4", help="draft tokens per step to try")
    ap.add_argument("--threads", type=int, default=0, help="numba threads (default: all cores)")
    args = ap.parse_args()
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    ks = [int(k) for k in args.k.split(",")]
    target = ember.load(DEMO_MODEL)
    drafts = {k: ember.load(DEMO_MODEL, draft=DEMO_DRAFT, draft_tokens=k) for k in ks}
    configs = {"autoregressive": target, **{f"draft k={k}": m for k, m in drafts.items()}}
    print(f"demo dense (Q8_0) + demo draft (Q8_0), {args.tokens} tokens x {len(PROMPTS)} prompts, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    for mode, options in MODES.items():
        for model in configs.values():
            decode(model, 8, options)  # warm: every kernel shape of this mode loaded
        runs: dict[str, list[tuple[float, SpecStats]]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, model in configs.items():
                runs[name].append(decode(model, args.tokens, options))
        base = statistics.median(r[0] for r in runs["autoregressive"])
        print(f"\n{mode}:\n| config | tok/s | speedup | acceptance | mean accepted length |\n|---|---|---|---|---|")
        for name, results in runs.items():
            rate = statistics.median(r[0] for r in results)
            stats = SpecStats(*(sum(getattr(r[1], f) for r in results) for f in ("proposed", "accepted", "steps")))
            extra = (f"{stats.acceptance_rate:.0%} | {stats.mean_accepted_length:.2f}" if stats.steps else "- | -")
            print(f"| {name} | {rate:.0f} | {rate / base:.2f}x | {extra} |")
    step, draft = forward_ms(target.net, 1), forward_ms(drafts[ks[0]]._draft, 1)
    print(f"\nwhat bounds it: target decode step {step:.3f} ms, draft step {draft:.3f} ms ({draft / step:.2f} of a step)")
    print("| k | verify k+1 tokens | per token | k draft steps | round | tokens/round for 1.8x |\n|---|---|---|---|---|---|")
    for k in ks:
        verify = forward_ms(target.net, k + 1)
        round_ms = k * draft + verify
        print(f"| {k} | {verify:.3f} ms ({verify / step:.2f} steps) | {verify / (k + 1):.3f} ms | {k * draft:.3f} ms "
              f"| {round_ms:.3f} ms | {1.8 * round_ms / step:.2f} (at most {k + 1}) |")


if __name__ == "__main__":
    main()
