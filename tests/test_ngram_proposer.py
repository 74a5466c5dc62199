"""Speculation by n-gram lookup (daemon/speculative/ngram_proposer.py): what the lookup proposes, and
that its proposals change no token's law — greedy output identical to decoding without them on the
trained demo model (alone, in lookup bursts, batched with prefix reuse, under preemption), seeded
sampling reproducible, and the joint law of sampled tokens the target's (point-mass proposals on a
small vocabulary)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ember
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence, Status
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.speculative.ngram_proposer import NGRAM, NgramProposer, PointMass, continuation
from ember.daemon.speculative.verification import Proposal, verify
from ember.kernels.sampling import SamplingParams
from ember.kernels.sampling_batch import sample
from test_engine_core import run
from test_speculative import SNIPPETS, greedy
from test_speculative_verification import PARAMS, PROMPT, TARGET, TRIALS, V, target_law


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int32)


def test_the_longest_latest_match_is_continued() -> None:
    # the last 3 tokens (1, 2, 3) occurred at 0: what followed them, then the text from there repeated
    assert continuation(ids(1, 2, 3, 4, 5, 1, 2, 3), 2, 4, 3) == [4, 5, 1]
    assert continuation(ids(1, 2, 3, 4, 5, 1, 2, 3), 2, 4, 8) == [4, 5, 1, 2, 3, 4, 5, 1]
    # the latest occurrence of the longest n-gram wins: (8, 1, 2) at 3, not (1, 2) at 0
    assert continuation(ids(1, 2, 7, 8, 1, 2, 9, 6, 8, 1, 2), 2, 4, 2) == [9, 6]
    assert continuation(ids(5, 1, 2, 7, 1, 2), 2, 4, 2) == [7, 1]  # (1, 2) occurred before at 1 only
    assert continuation(ids(7, 7, 7, 7), 2, 4, 3) == [7, 7, 7]  # a loop of period 1 goes on
    assert continuation(ids(1, 2, 3, 4), 2, 4, 3) == []  # nothing occurs twice
    assert continuation(ids(1, 2, 3, 1), 2, 4, 3) == []  # one token matching is below min_n
    assert continuation(ids(1, 2, 3, 1), 1, 4, 3) == [2, 3, 1]
    assert continuation(ids(1), 2, 4, 3) == [] and continuation(ids(), 2, 4, 3) == []


def test_the_compiled_lookup_is_the_lookup() -> None:
    """greedy_decode's lookup (inside a lookup burst's compiled loop) proposes what continuation does."""
    from ember.kernels.cpu.greedy_decode import _continuation

    rng = np.random.default_rng(1)
    for _ in range(400):
        size, k = int(rng.integers(0, 40)), int(rng.integers(0, 9))
        tokens = rng.integers(0, int(rng.integers(2, 6)), size + 10).astype(np.int32)
        out = np.empty(max(k, 1), np.int64)
        n = _continuation(tokens, size, 2, 4, k, out)
        assert out[:n].tolist() == continuation(tokens[:size], 2, 4, k)


def test_the_context_follows_the_sequence_as_it_grows_and_rewinds() -> None:
    """The proposer keeps each sequence's tokens as an array it appends to; a lookup at any known
    length (a preempted sequence runs again from earlier) equals one on the tokens themselves."""
    proposer = NgramProposer(vocab=100)
    seq = Sequence([1, 2, 3, 4, 1, 2], 50)
    rng = np.random.default_rng(0)
    ends = [6, 6, 3, 6]
    for _ in range(40):
        seq.generated.append(int(rng.integers(1, 6)))
        ends += [len(seq.tokens), int(rng.integers(1, len(seq.tokens) + 1))]
    for end in ends:
        assert proposer.lookup(seq.sampling, end, 4) == continuation(np.array(seq.tokens[:end], np.int32), 2, 4, 4)


def test_a_point_mass_proposal_keeps_the_target_law() -> None:
    """Proposals that are not drawn at all (copied tokens, q = a point mass) are accepted with
    probability p(token), and a rejection draws from p without it: t1, t2 over thousands of seeds follow
    the target's joint law."""
    counts = np.zeros((V, V))
    for seed in range(TRIALS):
        seq = Sequence(PROMPT, 10, PARAMS, seed=seed)
        d1, d2 = 2, 5  # the same copied tokens every time (a rule that draws the rejected token again shows)
        rows = np.stack([TARGET[0], TARGET[1][d1], TARGET[2][d1, d2]]).astype(np.float32)
        block = verify(rows, Proposal([d1, d2], [PointMass(d1, V), PointMass(d2, V)]), seq.sampling)  # type: ignore[list-item]
        t1 = block[0].token
        t2 = block[1].token if len(block) > 1 else sample(TARGET[1][t1], PARAMS, seq.rng, PROMPT, [t1]).token
        counts[t1, t2] += 1
    expected = target_law(PARAMS) * TRIALS
    assert counts[expected == 0].sum() == 0
    cells = expected > 0
    stat, df = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()), int(cells.sum()) - 1
    assert ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df)) < 4.0


@pytest.fixture(scope="module")
def target() -> ember.Model:
    return ember.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def lookup() -> ember.Model:
    model = ember.load(DEMO_MODEL, draft=NGRAM, draft_tokens=4)
    model.adaptive_draft = False  # every step with a match speculates: the path itself under test
    return model


def engine_of(model: ember.Model, kv_blocks: int, block_size: int = 16, **options) -> EngineCore:
    runner = ModelRunner(model.net, kv_blocks, block_size)
    options.setdefault("adaptive_draft", False)
    return EngineCore(runner, draft=NgramProposer(model.config.vocab), draft_tokens=4, **options)


def test_greedy_is_token_identical(target, lookup) -> None:
    """The demo model's greedy text repeats itself, so most steps have a match and most proposals
    stand; the tokens are those of decoding without proposals."""
    for text in SNIPPETS[:3]:
        assert list(lookup.generate(text, max_tokens=96, ignore_eos=True)) == greedy(target, text, 96), text
    stats = lookup.spec_stats()
    assert stats.steps > 20 and stats.proposed <= 4 * stats.steps
    assert stats.acceptance_rate > 0.5


def test_greedy_with_penalties_stops_and_max_tokens_is_token_identical(target, lookup) -> None:
    options = dict(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={271: -5.0, 25: 2.0}, logprobs=3)
    want = list(target.generate(SNIPPETS[0], max_tokens=64, ignore_eos=True, **options))
    assert list(lookup.generate(SNIPPETS[0], max_tokens=64, ignore_eos=True, **options)) == want
    full = greedy(target, SNIPPETS[2], 60)
    for stop in (full[20], full[41]):
        got = list(lookup.generate(SNIPPETS[2], max_tokens=60, stop_ids=[stop], ignore_eos=True))
        assert got == full[: full.index(stop) + 1]
    for max_tokens in (1, 2, 5, 37):
        assert list(lookup.generate(SNIPPETS[1], max_tokens=max_tokens, ignore_eos=True)) == \
            greedy(target, SNIPPETS[1], max_tokens)


def test_batched_with_prefix_reuse_and_preemption(target, lookup) -> None:
    prompts = [lookup.tokenize(s) for s in SNIPPETS]
    for blocks, expect_preemption in ((96, False), (20, True)):
        engine = engine_of(lookup, kv_blocks=blocks, block_size=4, max_step_tokens=40, max_running=8)
        seqs = [Sequence(p, max_tokens=40) for p in prompts]
        run(engine, {2 * i: [s] for i, s in enumerate(seqs)})
        for seq, prompt in zip(seqs, prompts):
            assert seq.status == Status.FINISHED and seq.generated == greedy(target, prompt, 40)
        assert engine.spec_stats.accepted > 0 and engine.stats().kv_blocks_free == blocks
        assert (engine.scheduler.preemptions > 0) == expect_preemption


def test_steps_without_a_match_decode_plainly(lookup) -> None:
    """A sequence whose context has no repeated n-gram is not given lookahead: nothing is proposed."""
    engine = engine_of(lookup, kv_blocks=16)
    submitted, submit = [], engine.executor.submit
    engine.executor.submit = lambda work: (submitted.append(work), submit(work))[1]  # type: ignore[method-assign]
    seq = Sequence(list(range(300, 340)), max_tokens=3)  # 40 distinct tokens: no 2-gram repeats in 43
    run(engine, {0: [seq]})
    assert seq.status == Status.FINISHED and len(submitted) == 3
    assert not any(w.propose or any(c.lookahead for c in w.chunks) for w in submitted)


def test_seeded_sampling_reproduces_alone_and_in_company(lookup) -> None:
    options = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1)
    alone = list(lookup.generate(SNIPPETS[0], max_tokens=48, seed=7, ignore_eos=True, **options))
    assert list(lookup.generate(SNIPPETS[0], max_tokens=48, seed=7, ignore_eos=True, **options)) == alone
    engine = engine_of(lookup, kv_blocks=64)
    seq = Sequence(lookup.tokenize(SNIPPETS[0]), 48, SamplingParams(**options), seed=7)
    others = [Sequence(lookup.tokenize(t), 48, SamplingParams(**options), seed=i) for i, t in enumerate(SNIPPETS[1:4])]
    run(engine, {0: others, 3: [seq]})
    assert seq.generated == alone


def test_a_lookup_burst_gives_the_greedy_tokens(target) -> None:
    """One greedy sequence decodes in lookup bursts: each round verifies n-gram proposals inside the
    compiled loop (ModelRunner.lookup_steps), the tokens those of plain greedy steps, stops and
    max_tokens landing inside a round included."""
    model = ember.load(DEMO_MODEL, draft=NGRAM, draft_tokens=5)
    budgets: list[int] = []
    lookup_steps = model.net.lookup_steps
    model.net.lookup_steps = lambda *a: (budgets.append(a[2]), lookup_steps(*a))[1]  # type: ignore[method-assign]
    for text in SNIPPETS[:3]:
        assert list(model.generate(text, max_tokens=120, ignore_eos=True)) == greedy(target, text, 120), text
    stats = model.spec_stats()
    assert budgets and max(budgets) > 8 and stats.accepted > 0.5 * stats.proposed > 0
    full = greedy(target, SNIPPETS[2], 100)
    for stop in (full[30], full[77]):
        got = list(model.generate(SNIPPETS[2], max_tokens=100, stop_ids=[stop], ignore_eos=True))
        assert got == full[: full.index(stop) + 1]
    for max_tokens in (3, 41, 97):
        assert list(model.generate(SNIPPETS[1], max_tokens=max_tokens, ignore_eos=True)) == \
            greedy(target, SNIPPETS[1], max_tokens)


def test_adaptive_lookup_keeps_the_tokens(target) -> None:
    """With the switch on (the default), steps alternate between proposals and plain bursts as the
    switch measures them; the greedy tokens stay the target's."""
    model = ember.load(DEMO_MODEL, draft=NGRAM, draft_tokens=4)
    for text in SNIPPETS[:2]:
        assert list(model.generate(text, max_tokens=200, ignore_eos=True)) == greedy(target, text, 200)
    assert model.spec_stats().steps > 0
