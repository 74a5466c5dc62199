"""Speculative decoding with the trained demo pair (daemon/assets: the dense model and its draft).

Greedy: token-identical to decoding without a draft — alone, under continuous batching with
prefix reuse and preemption, and with stops and max_tokens landing inside a proposed block.
Sampled: seeded requests reproduce; the distribution of tokens 2-4 over thousands of seeds matches
decoding without a draft (test_speculative_verification.py shows the statistic sees a wrong rule)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import ember
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence, Status
from ember.daemon.loader.demo_model import DEMO_DRAFT, DEMO_MODEL
from ember.daemon.models.dflash import DFlashDraft
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.speculative.feature_proposer import FeatureProposer
from ember.kernels.sampling import SamplingParams
from test_engine_core import run

SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
            "for i in range(10):\n    print(", "# read the config file\nwith open(", "x = ["]


@pytest.fixture(scope="module")
def target() -> ember.Model:
    return ember.load(DEMO_MODEL)


def speculating(model: ember.Model) -> ember.Model:
    """model, its draft speculating on every step (not only where that measures faster: these tests
    are about the speculative path itself; tests/test_spec_switch.py has the switch)."""
    model.adaptive_draft = False
    return model


@pytest.fixture(scope="module")
def spec() -> ember.Model:
    return speculating(ember.load(DEMO_MODEL, draft=DEMO_DRAFT, draft_tokens=4))


def engine_of(model: ember.Model, kv_blocks: int, block_size: int = 16, draft_tokens: int = 4,
              feature_dtype: str = "f32", **options) -> EngineCore:
    """An engine of model's target and draft (a draft model, or a DFlash draft: tests/test_dflash.py)."""
    runner = ModelRunner(model.net, kv_blocks, block_size)
    if isinstance(model._draft, DFlashDraft):
        draft: ModelRunner | FeatureProposer | None = FeatureProposer(model._draft, runner, feature_dtype=feature_dtype)
    else:
        draft = ModelRunner(model._draft, kv_blocks, block_size) if model._draft is not None else None
    options.setdefault("adaptive_draft", False)
    return EngineCore(runner, draft=draft, draft_tokens=draft_tokens, **options)


_greedy: dict[tuple[int, ...], list[int]] = {}


def greedy(target: ember.Model, prompt: str | list[int], max_tokens: int) -> list[int]:
    """The target's own greedy tokens, without a draft (computed once per prompt)."""
    ids = tuple(target.tokenize(prompt) if isinstance(prompt, str) else prompt)
    if len(_greedy.get(ids, ())) < max_tokens:
        _greedy[ids] = list(target.generate(list(ids), max_tokens=max(max_tokens, 80), ignore_eos=True))
    return _greedy[ids][:max_tokens]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_is_token_identical(target, k: int) -> None:
    spec = speculating(ember.load(DEMO_MODEL, draft=DEMO_DRAFT, draft_tokens=k))
    for text in SNIPPETS[:3]:
        assert list(spec.generate(text, max_tokens=80, ignore_eos=True)) == greedy(target, text, 80), text
    stats = spec.spec_stats()
    assert stats.steps > 0 and stats.proposed <= k * stats.steps
    assert stats.acceptance_rate > 0.5  # the trained pair agrees (77% in transformers at k=4)
    assert stats.mean_accepted_length > 1 + 0.5 * min(k, 2)


def test_the_draft_stops_where_it_is_unsure(target, spec) -> None:
    """DraftProposer's rule: after a proposal whose draft distribution's top probability is below
    min_prob, no more that step. 1.0 stops after every first proposal, 0 never stops early; the
    tokens are the target's either way, and the default stops some of the time."""
    prompt = spec.tokenize(SNIPPETS[2])
    proposed = {}
    for min_prob in (0.0, 0.6, 1.0):
        engine = engine_of(spec, kv_blocks=16)
        engine.proposer.min_prob = min_prob
        seq = Sequence(prompt, 60)
        run(engine, {0: [seq]})
        assert seq.generated == greedy(target, prompt, 60)
        proposed[min_prob] = engine.spec_stats.proposed / engine.spec_stats.steps
    assert proposed[1.0] == 1.0 and proposed[0.0] > 3.5  # k = 4 but near max_tokens
    assert 1.0 < proposed[0.6] < proposed[0.0]


def test_greedy_with_penalties_and_bias_is_token_identical(target, spec) -> None:
    options = dict(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={271: -5.0, 25: 2.0}, logprobs=3)
    want = [c for c in target.generate(SNIPPETS[0], max_tokens=64, ignore_eos=True, **options)]
    assert list(spec.generate(SNIPPETS[0], max_tokens=64, ignore_eos=True, **options)) == want


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 13])
def test_max_tokens_inside_a_block(target, spec, max_tokens: int) -> None:
    got = list(spec.generate(SNIPPETS[1], max_tokens=max_tokens, ignore_eos=True))
    assert got == greedy(target, SNIPPETS[1], max_tokens) and len(got) == max_tokens


def test_a_stop_id_inside_a_block_ends_there(target, spec) -> None:
    full = greedy(target, SNIPPETS[2], 40)
    for stop in (full[5], full[17], full[30]):
        got = list(spec.generate(SNIPPETS[2], max_tokens=40, stop_ids=[stop], ignore_eos=True))
        assert got == full[: full.index(stop) + 1]


def test_the_context_limit_inside_a_block(target, spec) -> None:
    prompt = target.tokenize(SNIPPETS[0])
    engines = [engine_of(m, kv_blocks=4, max_context=len(prompt) + 11) for m in (target, spec)]
    seqs = [Sequence(prompt, max_tokens=100) for _ in engines]
    for engine, seq in zip(engines, seqs):
        run(engine, {0: [seq]})
    assert seqs[0].generated == seqs[1].generated and len(seqs[1].tokens) == len(prompt) + 11
    assert seqs[1].finish_reason == "length"


def test_batched_with_prefix_reuse_and_logit_streams(target, spec) -> None:
    """Sequences arrive while others decode; prefixes are shared; one asks for its logits (it decodes
    without proposals); every sequence gets exactly its tokens alone."""
    prompts = [spec.tokenize(s) for s in SNIPPETS] + [spec.tokenize(SNIPPETS[0] + "\n    return")]
    engine = engine_of(spec, kv_blocks=96, block_size=4, max_step_tokens=40, max_running=8, prefix_caching=True)
    seqs = [Sequence(p, max_tokens=48) for p in prompts]
    seqs[2].wants_logits = True
    run(engine, {2 * i: [s] for i, s in enumerate(seqs)})
    for seq, prompt in zip(seqs, prompts):
        assert seq.generated == greedy(target, prompt, 48)
    assert engine.spec_stats.steps > 0 and engine.stats().prefix_hits > 0
    assert engine.stats().kv_blocks_free == 96


def test_kv_exhaustion_preempts_and_finishes_everything(target, spec) -> None:
    prompts = [spec.tokenize(s) for s in SNIPPETS]
    engine = engine_of(spec, kv_blocks=12, block_size=4, max_step_tokens=32)
    seqs = [Sequence(p, max_tokens=24) for p in prompts]
    run(engine, {0: seqs})
    assert engine.scheduler.preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.status == Status.FINISHED
        assert seq.generated == greedy(target, prompt, 24)


def test_seeded_sampling_reproduces_alone_and_in_company(spec) -> None:
    options = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    alone = list(spec.generate(SNIPPETS[0], max_tokens=40, seed=7, ignore_eos=True, **options))
    assert list(spec.generate(SNIPPETS[0], max_tokens=40, seed=7, ignore_eos=True, **options)) == alone
    assert list(spec.generate(SNIPPETS[0], max_tokens=40, seed=8, ignore_eos=True, **options)) != alone
    engine = engine_of(spec, kv_blocks=64)
    prompt = spec.tokenize(SNIPPETS[0])
    seq = Sequence(prompt, 40, SamplingParams(**options), seed=7)
    others = [Sequence(spec.tokenize(t), 40, SamplingParams(**options), seed=i) for i, t in enumerate(SNIPPETS[1:4])]
    run(engine, {0: others, 3: [seq]})
    assert seq.generated == alone


# --- the distribution of sampled tokens ------------------------------------------------------------
SEEDS = 2000
# top-k/p are covered exactly on a small vocabulary by test_speculative_verification.py
PARAMS = SamplingParams(temperature=1.0, min_p=0.03, repetition_penalty=1.2, logit_bias={25: 1.5})


def later_tokens(model: ember.Model, draft_tokens: int = 3) -> tuple[list[Counter], EngineCore]:
    """Tokens 2, 3 and 4 of SEEDS sampled continuations of one prompt, counted per position."""
    prompt = model.tokenize("def main(")
    engine = engine_of(model, kv_blocks=SEEDS, block_size=4, draft_tokens=draft_tokens, max_running=256,
                       max_step_tokens=1024, prefix_caching=True)
    seqs = [Sequence(prompt, 4, PARAMS, seed=s) for s in range(SEEDS)]
    run(engine, {0: seqs})
    return [Counter(s.generated[i] for s in seqs) for i in (1, 2, 3)], engine


def chi_square_z(a: Counter, b: Counter) -> float:
    """Two-sample chi-square of token counts (tokens seen fewer than 10 times in all pooled), as a
    z-score through the Wilson-Hilferty approximation: ~N(0, 1) when both come from one law."""
    total = a + b
    common = [t for t, n in total.items() if n >= 10]
    rest = lambda c: sum(n for t, n in c.items() if t not in common)  # noqa: E731
    rows = np.array([[a[t] for t in common] + [rest(a)], [b[t] for t in common] + [rest(b)]], float)
    rows = rows[:, rows.sum(axis=0) > 0]
    expected = rows.sum(axis=1, keepdims=True) * rows.sum(axis=0, keepdims=True) / rows.sum()
    stat, df = float(((rows - expected) ** 2 / expected).sum()), rows.shape[1] - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


@pytest.fixture(scope="module")
def plain_later_tokens(target) -> list[Counter]:
    return later_tokens(target)[0]


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(spec, plain_later_tokens) -> None:
    """The statistic's power is checked on a small vocabulary in test_speculative_verification.py. On
    this model, when this test was written, 1500 seeds gave z = -0.94, -0.26, 0.60 for tokens 2-4, and
    4.83, 3.32, 1.24 with the classic wrong residual (drawing again from p after a rejection)."""
    got, engine = later_tokens(spec)
    assert engine.spec_stats.accepted > 0.3 * engine.spec_stats.proposed  # 42% here: temperature 1 and penalties
    for position, (a, b) in enumerate(zip(plain_later_tokens, got), start=2):
        assert chi_square_z(a, b) < 4.0, f"token {position} differs: {a.most_common(5)} vs {b.most_common(5)}"
