"""Speculative decoding on the CPU: autoregressive vs draft-model vs feature-draft decoding of the
trained demo model (daemon/assets: the dense model, its draft model and its DFlash draft), greedy and at
temperature 0.7, in one run.

For each mode, the configurations alternate --rounds times (so the machine's drift hits them alike)
and each figure is the median over the rounds: tok/s of --tokens generated tokens after each of the
prompts (one sequence at a time, ignore_eos, as Model.generate runs), the draft's acceptance rate,
the mean accepted length (tokens per verification pass, the target's own one included) and the
proposals per verification pass (each one a draft pass and a verification row; the draft stops
early where it is unsure, DraftProposer.min_prob, except in the "full" configuration). Then what
bounds the speedup, measured on the same models: one target decode step (1 token), verification
forwards (n tokens), one draft step, the host work of sampled verification, and for each
configuration the speedup the measured costs predict,
L x t_step / (P x t_draft + t_verify(1 + P)) for mean accepted length L and P proposals per pass.
A feature draft ("dflash k=") proposes its k tokens in one pass over a block of k + 1 rows:
its round costs t_block(k + 1) + t_verify(1 + k) instead. "ngram k=" has no draft model: up to k
tokens copied from the sequence's own context (prompt lookup, daemon/speculative/ngram_proposer.py),
which costs no pass (its round: t_verify(1 + P)), in the steps where some sequence has a match, under
the adaptive switch as users get it. The demo model's greedy text loops, so its figures are those of
text that repeats itself; a text that never repeats an n-gram is decoded plainly.

The "draft k=" configurations speculate on every step; "adaptive k=" is the default, where the
engine speculates only while that measures faster than decoding without the draft (its compiled
decode bursts included; daemon/speculative/spec_switch.py): its row says what share of the tokens
were decoded plainly. The sampled mode has no seed (a seeded sampled request always speculates, so
that its seed reproduces it). Then --streams sequences decoded together (aggregate tok/s) for the
autoregressive, adaptive and always-speculating configurations.

--target-layers N replaces the demo target by the demo target deepened to N layers
(benchmarks/deep_target.py: the same logits at N / 5 times the layer weights a step; no DFlash rows,
that draft reads the demo's own layers): a target step then costs ~10 draft steps, where the demo's
costs ~2.5, so speculation has room to pay.

    python benchmarks/speculative.py [--tokens 128] [--rounds 3] [--k 3,4,6] [--full-k 4] [--feature-k 2,4,7]
                                     [--adaptive-k 4] [--ngram-k 4,7] [--streams 8] [--threads N]
                                     [--target-layers N]
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
import statistics
import time

import numpy as np

import ember
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_DFLASH, DEMO_DRAFT, DEMO_MODEL
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.speculative.ngram_proposer import NGRAM
from ember.daemon.speculative.spec_stats import SpecStats
from ember.daemon.speculative.verification import Proposal, draft_choice, verify
from ember.kernels.sampling import SamplingParams

from deep_target import deep_target

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
           "for i in range(10):\n    print("]
MODES = {"greedy": {}, "t=0.7": {"temperature": 0.7}}


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
    return generated / elapsed, _spent(before, model.spec_stats())


def _spent(before: SpecStats, after: SpecStats) -> SpecStats:
    return SpecStats(after.proposed - before.proposed, after.accepted - before.accepted, after.steps - before.steps,
                     after.plain_tokens - before.plain_tokens)


def decode_together(model: ember.Model, streams: int, tokens: int, options: dict) -> tuple[float, SpecStats]:
    """Aggregate tok/s of `streams` sequences stepped together (timed from every prompt's first token on)."""
    params = SamplingParams(**options)
    engine = model.engine(streams * (32 + tokens + 1), max_running=streams)
    seqs = [Sequence(model.tokenize(PROMPTS[i % len(PROMPTS)]) + [100 + i], tokens + 1, params) for i in range(streams)]
    for seq in seqs:
        engine.add(seq)
    while any(not seq.generated for seq in seqs):
        engine.step()
    before, done, t0 = model.spec_stats(), sum(len(s.generated) for s in seqs), time.perf_counter()
    while engine.has_work:
        engine.step()
    return (sum(len(s.generated) for s in seqs) - done) / (time.perf_counter() - t0), _spent(before, model.spec_stats())


def forward_ms(net, n: int, context: int = 64, reps: int = 200) -> float:  # type: ignore[no-untyped-def]
    """One forward pass of n generated tokens after `context` positions, in milliseconds (median of 5)."""
    runner = ModelRunner(net, 16, 16)
    table = list(range(16))
    net.forward(runner.prepare(StepBatch.build([(list(range(1, context + 1)), 0, table)], 16, prompt_lengths=[context])),
                runner.cache)
    batch = runner.prepare(StepBatch.build([(list(range(100, 100 + n)), context, table)], 16,
                                           prompt_lengths=[context], logit_tails=[n]))
    return _median_ms(lambda: net.forward(batch, runner.cache), reps)


def feature_block_ms(model: ember.Model, k: int, context: int = 64, reps: int = 200) -> float:
    """One pass of model's DFlash draft over a noise block of k + 1 tokens after `context` injected
    positions, in milliseconds (median of 5)."""
    draft = model._draft
    runner = ModelRunner(model.net, 16, 16)
    table = list(range(16))
    cache = draft.new_cache(16, 16)
    features = np.random.default_rng(0).normal(size=(context, draft.width)).astype(np.float32)
    draft.inject(draft.ops.to_device(features), runner.prepare(
        StepBatch.build([(list(range(1, context + 1)), 0, table)], 16, prompt_lengths=[context])), cache)
    block = StepBatch.build([([100] + [draft.spec.mask_id] * k, context, table)], 16, prompt_lengths=[context],
                            logit_tails=[k])
    batch = runner.prepare(replace(block, attn_end=np.full(k + 1, context + k)))
    return _median_ms(lambda: draft.block_logits(batch, cache), reps)


def sampled_verification_ms(k: int, vocab: int, reps: int = 100) -> float:
    """The host work of one sampled round at temperature 0.7 (k draft choices, then verifying k + 1
    rows with every proposal accepted: the most rows a round reads), in milliseconds."""
    rows = np.random.default_rng(0).normal(size=(k + 1, vocab)).astype(np.float32) * 3
    seq = Sequence([1, 2, 3], 1000, SamplingParams(temperature=0.7), seed=0).sampling

    def one_round() -> None:
        tokens, probs = [], []
        for i in range(k):
            token, q = draft_choice(rows[i], seq, tokens)
            tokens.append(token)
            probs.append(q)
        verify(rows, Proposal(tokens, probs), seq)  # the draft's rows are the target's: all accepted
    return _median_ms(one_round, reps)


def _median_ms(work, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            work()
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", default="3,4,6", help="draft tokens per step to try")
    ap.add_argument("--full-k", type=int, default=4, help="also this k drafting every token (no early stop; 0: skip)")
    ap.add_argument("--feature-k", default="2,4,7", help="the DFlash draft's tokens per step to try ('': none)")
    ap.add_argument("--adaptive-k", type=int, default=4, help="the adaptive draft's tokens per step (0: skip)")
    ap.add_argument("--ngram-k", default="4,7", help="n-gram lookup's tokens per step to try ('': none)")
    ap.add_argument("--streams", type=int, default=8, help="sequences decoded together in the batched figure (0: skip)")
    ap.add_argument("--threads", type=int, default=0, help="numba threads (default: all cores)")
    ap.add_argument("--target-layers", type=int, default=0,
                    help="the demo target deepened to this many layers (benchmarks/deep_target.py; 0: the demo itself)")
    args = ap.parse_args()
    if args.threads:
        import numba

        numba.set_num_threads(args.threads)
    ks = [int(k) for k in args.k.split(",")]
    target_path = str(deep_target(args.target_layers)) if args.target_layers else DEMO_MODEL
    if args.target_layers:
        args.feature_k = ""  # the DFlash draft reads the demo target's layers by index: not a deep target's
    target = ember.load(target_path)
    configs = {"autoregressive": target}
    configs |= {f"draft k={k}": always(ember.load(target_path, draft=DEMO_DRAFT, draft_tokens=k)) for k in ks}
    if args.full_k:
        full = configs[f"draft k={args.full_k} full"] = always(ember.load(target_path, draft=DEMO_DRAFT,
                                                                          draft_tokens=args.full_k))
        full.draft_min_prob = 0.0
    if args.adaptive_k:
        configs[f"adaptive k={args.adaptive_k}"] = ember.load(target_path, draft=DEMO_DRAFT, draft_tokens=args.adaptive_k)
    fks = [int(k) for k in args.feature_k.split(",") if k]
    configs |= {f"dflash k={k}": ember.load(target_path, draft=DEMO_DFLASH, draft_tokens=k) for k in fks}
    nks = [int(k) for k in args.ngram_k.split(",") if k]
    configs |= {f"ngram k={k}": ember.load(target_path, draft=NGRAM, draft_tokens=k) for k in nks}
    name = f"demo dense deepened to {args.target_layers} layers (benchmarks/deep_target.py)" if args.target_layers \
        else "demo dense"
    print(f"{name} (Q8_0) + demo draft (Q8_0) + demo DFlash draft (Q8_0), {args.tokens} tokens x {len(PROMPTS)} prompts, "
          f"{args.rounds} rounds, {os.cpu_count()} CPUs")
    results: dict[str, dict[str, tuple[float, SpecStats]]] = {}
    for mode, options in MODES.items():
        for model in configs.values():
            decode(model, 8, options)  # warm: every kernel shape of this mode loaded
        runs: dict[str, list[tuple[float, SpecStats]]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, model in configs.items():
                runs[name].append(decode(model, args.tokens, options))
        results[mode] = {name: (statistics.median(r[0] for r in rs), SpecStats(
            *(sum(getattr(r[1], f) for r in rs) for f in ("proposed", "accepted", "steps", "plain_tokens"))))
            for name, rs in runs.items()}

    most = max(ks + [args.full_k] + fks + nks) + 1
    verify_ms = [0.0] + [forward_ms(target.net, n) for n in range(1, most + 1)]  # verify_ms[n]: n tokens
    step, draft = verify_ms[1], forward_ms(configs[f"draft k={ks[0]}"]._draft, 1)
    sampling = sampled_verification_ms(4, target.config.vocab)
    block_ms = {f"dflash k={k}": feature_block_ms(configs[f"dflash k={k}"], k) for k in fks}

    def verify_steps(rows: float) -> float:  # linear between the measured whole row counts
        lo = min(int(rows), most - 1)
        return (verify_ms[lo] + (rows - lo) * (verify_ms[lo + 1] - verify_ms[lo])) / step

    for mode, table in results.items():
        base = table["autoregressive"][0]
        print(f"\n{mode}:\n| config | tok/s | speedup | acceptance | mean accepted length | proposals per pass "
              f"| round cost (target steps) | predicted speedup |\n|---|---|---|---|---|---|---|---|")
        for name, (rate, stats) in table.items():
            plain = f" ({stats.plain_tokens} tokens plain)" if stats.plain_tokens else ""
            if not stats.steps:
                print(f"| {name}{plain} | {rate:.0f} | {rate / base:.2f}x | - | - | - | 1.00 | 1.00x |")
                continue
            per = stats.proposed / stats.steps
            # a feature draft: one block pass; n-grams: a lookup, no pass
            drafting = block_ms[name] if name in block_ms else 0.0 if name.startswith("ngram") else per * draft
            cost = drafting / step + verify_steps(1 + per)
            print(f"| {name}{plain} | {rate:.0f} | {rate / base:.2f}x | {stats.acceptance_rate:.0%} | "
                  f"{stats.mean_accepted_length:.2f} | {per:.2f} | {cost:.2f} | {stats.mean_accepted_length / cost:.2f}x |")
    print(f"\nwhat bounds it: target decode step {step:.3f} ms, draft step {draft:.3f} ms ({draft / step:.2f} of a step); "
          f"sampled host work of a k=4 round (4 draft choices, 5 rows verified) {sampling:.3f} ms ({sampling / step:.2f} of a step)")
    for name, ms in block_ms.items():
        print(f"{name}: one block pass of {name[9:]} + 1 tokens {ms:.3f} ms ({ms / step:.2f} of a step)")
    print("| tokens verified | ms | target steps | per token |\n|---|---|---|---|")
    for n in range(1, most + 1):
        print(f"| {n} | {verify_ms[n]:.3f} | {verify_ms[n] / step:.2f} | {verify_ms[n] / n / step:.2f} |")
    if args.streams:
        batched(configs, args)


def batched(configs: dict[str, ember.Model], args: argparse.Namespace) -> None:
    """--streams sequences together: autoregressive, adaptive, n-grams and always speculating, alternated."""
    names = [n for n in configs if n == "autoregressive" or n.startswith(("adaptive", "ngram"))
             or n == f"draft k={args.adaptive_k}"]
    print(f"\n{args.streams} streams together, aggregate tok/s (medians of {args.rounds} rounds):\n"
          f"| mode | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for mode, options in MODES.items():
        for name in names:
            decode_together(configs[name], args.streams, 16, options)  # warm: this batch's kernel shapes
        runs: dict[str, list[tuple[float, SpecStats]]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                runs[name].append(decode_together(configs[name], args.streams, args.tokens, options))
        base = statistics.median(r[0] for r in runs["autoregressive"])
        cells = []
        for name in names:
            rate = statistics.median(r[0] for r in runs[name])
            plain = sum(r[1].plain_tokens for r in runs[name])
            cells.append(f"{rate:.0f} ({rate / base:.2f}x{f', {plain} plain' if plain else ''})")
        print(f"| {mode} | " + " | ".join(cells) + " |")


def always(model: ember.Model) -> ember.Model:
    """model, its draft speculating on every step (the adaptive switch off)."""
    model.adaptive_draft = False
    return model


if __name__ == "__main__":
    main()
