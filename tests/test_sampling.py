"""The sampler against independent numpy references on fixed logits: penalties exactly, distributions
by chi-square over many draws."""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.sampling import SampleRow, SamplingParams, choice_of, final_distribution, penalized_logits
from ember.kernels.sampling_batch import SamplingBatch, sample, sample_batch

rng0 = np.random.default_rng(3)
LOGITS = (rng0.standard_normal(50) * 2).astype(np.float32)


def reference_distribution(logits: np.ndarray, t: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """HF-style warpers written out plainly: temperature, then top-k, top-p, min-p on a sorted copy."""
    p = np.exp(logits.astype(np.float64) / t)
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = set(order[:top_k] if top_k else order)
    mass, nucleus = 0.0, set()
    for i in order:
        nucleus.add(i)
        mass += p[i]
        if mass >= top_p:
            break
    kept &= nucleus
    kept &= {i for i in range(len(p)) if p[i] >= min_p * p[order[0]]}
    q = np.array([p[i] if i in kept else 0.0 for i in range(len(p))])
    return q / q.sum()


def chi_square(draws: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    counts = np.bincount(draws, minlength=probs.size)
    assert counts[probs == 0].sum() == 0, "drew a token the distribution excludes"
    support = probs > 0
    expected = probs[support] * draws.size
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1), dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
])
def test_distribution_matches_reference_and_draws_follow_it(params: dict) -> None:
    sp = SamplingParams(**params)
    ref = reference_distribution(LOGITS, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    np.testing.assert_allclose(final_distribution(LOGITS, sp), ref, rtol=1e-9, atol=1e-12)
    rng = np.random.default_rng(11)
    draws = np.array([sample(LOGITS, sp, rng).token for _ in range(6000)])
    stat, df = chi_square(draws, ref)
    if df > 0:  # critical value far beyond chance (df + 6 sd) so the test fails only on a real bias
        assert stat < df + 6 * np.sqrt(2 * df), (stat, df)


def test_greedy_equivalences() -> None:
    rng = np.random.default_rng(0)
    best = int(np.argmax(LOGITS))
    assert sample(LOGITS, SamplingParams(), rng).token == best
    assert sample(LOGITS, SamplingParams(temperature=0.0, top_p=0.5), rng).token == best
    assert all(sample(LOGITS, SamplingParams(temperature=1.5, top_k=1), rng).token == best for _ in range(50))


def test_repetition_penalty_exact_with_window_and_prompt() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], np.float32)
    sp = SamplingParams(repetition_penalty=2.0, repetition_window=3)
    # history = prompt + generated = [0, 1, 1, 4, 5]; the window of 3 sees tokens {1, 4, 5}
    out = penalized_logits(logits, sp, prompt=[0, 1], generated=[1, 4, 5])
    np.testing.assert_array_equal(out, [2.0, -2.0, 0.5, 3.0, -4.0, 0.5])
    no_prompt = SamplingParams(repetition_penalty=2.0, repetition_window=-1, penalize_prompt=False)
    np.testing.assert_array_equal(penalized_logits(logits, no_prompt, [0, 1], [3]), [2.0, -1.0, 0.5, 1.5, -2.0, 1.0])


def test_frequency_presence_and_bias_exact() -> None:
    logits = np.zeros(5, np.float32)
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: 3.0, 0: -100.0})
    out = penalized_logits(logits, sp, prompt=[2, 2, 2], generated=[1, 1, 3, 1])  # prompt not counted
    np.testing.assert_allclose(out, [-100.0, -(3 * 0.5 + 0.25), 0.0, -(0.5 + 0.25), 3.0])


def test_logprobs_of_chosen_and_top_tokens() -> None:
    sp = SamplingParams(logprobs=3)
    choice = sample(LOGITS, sp, np.random.default_rng(0))
    ref = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert choice.token == int(np.argmax(LOGITS)) and choice.logprob == pytest.approx(ref.max())
    assert [t for t, _ in choice.top] == list(np.argsort(-ref)[:3])
    assert [lp for _, lp in choice.top] == pytest.approx(sorted(ref)[::-1][:3])


def test_same_seed_same_tokens() -> None:
    sp = SamplingParams(temperature=1.0)
    r1, r2, r3 = np.random.default_rng(42), np.random.default_rng(42), np.random.default_rng(43)
    first = [sample(LOGITS, sp, r1).token for _ in range(30)]
    assert first == [sample(LOGITS, sp, r2).token for _ in range(30)]
    assert first != [sample(LOGITS, sp, r3).token for _ in range(30)]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=2),
                                 dict(repetition_penalty=0), dict(frequency_penalty=3), dict(logit_bias={1: 1e9}),
                                 dict(logprobs=100)])
def test_invalid_parameters_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@pytest.mark.parametrize("name", FLOAT_PARAMS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e300, -6.5e91])
def test_non_finite_and_absurd_values_are_refused(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("bad", [dict(repetition_penalty=1e-310), dict(repetition_penalty=5e-324),
                                 dict(temperature=101.0), dict(logit_bias={3: float("nan")})])
def test_values_that_poisoned_a_batch_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("params", [
    dict(temperature=1e-310), dict(temperature=4e-312, min_p=7e-322), dict(temperature=5e-324, top_p=5e-324),
    dict(temperature=100.0, repetition_penalty=100.0, frequency_penalty=-2.0, presence_penalty=-2.0),
    dict(temperature=1e-6, repetition_penalty=0.01, logit_bias={0: 100.0, 1: -100.0}),
])
def test_extreme_accepted_values_sample_a_finite_distribution(params: dict) -> None:
    sp = SamplingParams(**params)
    logits = (np.random.default_rng(5).standard_normal(1000) * 30).astype(np.float32)  # a wide row
    generated = [0, 0, 1, 2, 3, 3, 3]
    probs = final_distribution(penalized_logits(logits, sp, [4, 5], generated), sp)
    assert np.isfinite(probs).all() and abs(probs.sum() - 1.0) < 1e-9
    rng = np.random.default_rng(1)
    tokens = {sample(logits, sp, rng, [4, 5], generated).token for _ in range(20)}
    if sp.temperature < 1e-300:  # the limit of a vanishing temperature is greedy
        assert tokens == {int(np.argmax(penalized_logits(logits, sp, [4, 5], generated)))}


def full_sort_kept(probs: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The kept set as final_distribution computed it before it sorted only the top of the vocabulary."""
    keep = np.ones(probs.size, bool)
    order = np.argsort(-probs, kind="stable")
    if 0 < top_k < probs.size:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        keep[order[int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1:]] = False
    return keep


@pytest.mark.parametrize("scale, ties", [(3.0, False), (0.2, False), (3.0, True), (0.01, True)])
def test_top_k_and_top_p_keep_exactly_what_a_full_sort_keeps(scale: float, ties: bool) -> None:
    """The partial sort keeps the same tokens as sorting the whole vocabulary, ties at the boundary
    and nuclei of thousands of tokens (flat distributions) included."""
    rng = np.random.default_rng(5)
    for trial in range(40):
        logits = (rng.standard_normal(8192) * scale).astype(np.float32)
        if ties:  # many exact ties: few distinct values
            logits = np.round(logits * 4) / 4
        for top_k, top_p in ((0, 0.9), (0, 0.999), (40, 1.0), (40, 0.5), (3000, 0.95), (1, 0.9), (0, 0.3)):
            sp = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
            got = final_distribution(logits, sp) > 0
            p = np.exp(logits.astype(np.float64) - logits.max())
            want = full_sort_kept(p / p.sum(), top_k, top_p)
            assert np.array_equal(got, want), (trial, top_k, top_p)


def random_rows(seed: int, vocab: int) -> list[SampleRow]:
    """Rows with every option drawn at random: histories, bias, penalties, truncation, grammars."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(12):
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.5, 1.0, 1.7])), top_k=int(rng.choice([0, 1, 5, 40])),
            top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05])),
            repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])), repetition_window=int(rng.choice([-1, 4, 64])),
            penalize_prompt=bool(rng.integers(2)), frequency_penalty=float(rng.choice([0.0, 0.5, -0.3])),
            presence_penalty=float(rng.choice([0.0, 0.25])), logprobs=int(rng.choice([0, 3])),
            logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, vocab, rng.integers(0, 4))})
        allowed = None
        if rng.integers(3) == 0:  # a grammar: a few allowed tokens, or most of them
            bits = rng.random(vocab) < rng.choice([0.05, 0.8])
            allowed = np.packbits(np.pad(bits, (0, -vocab % 32)), bitorder="little").view(np.int32)
        rows.append(SampleRow(int(rng.integers(0, 4)), params, np.random.default_rng(seed * 100 + k),
                              list(rng.integers(0, vocab, rng.integers(0, 20))), list(rng.integers(0, vocab, rng.integers(0, 20))),
                              bool(rng.integers(2)), allowed))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_samples_what_numpy_draws_from_the_penalised_law(seed: int) -> None:
    """SamplingBatch (each row's options as arrays, its one uniform number drawn when the batch is built)
    gives every row the token numpy's own Generator.choice draws, with the same generator, from the
    distribution of kernels/sampling.py's steps (penalized_logits, final_distribution); argmax where
    greedy; the logprobs of choice_of."""
    vocab = 150
    logits = (np.random.default_rng(seed).standard_normal((4, vocab)) * 3).astype(np.float32)
    for _ in range(3):  # the generators advance as they would row by row
        rows = random_rows(seed, vocab)
        twins = random_rows(seed, vocab)
        got = sample_batch(logits, SamplingBatch.of(rows))
        for r, choice in zip(twins, got, strict=True):
            penalized = penalized_logits(logits[r.row], r.params, r.prompt, r.generated, r.allowed)
            if r.params.greedy:
                want = int(np.argmax(penalized))
            else:
                want = int(r.rng.choice(vocab, p=final_distribution(penalized, r.params)))
            assert choice.token == want, r
            if r.logprob or r.params.logprobs:
                ref = choice_of(penalized, want, r.params.logprobs)
                assert choice.logprob == ref.logprob and choice.top == ref.top
            else:
                assert np.isnan(choice.logprob)


def test_a_batch_holds_each_rows_adjustments_exactly() -> None:
    """The sparse adjustments give penalized_logits' values bit for bit, for every row of a batch, and a
    selection of rows keeps each one's own entries and uniform number."""
    vocab = 150
    logits = (np.random.default_rng(5).standard_normal(vocab) * 3).astype(np.float32)
    rows = random_rows(7, vocab)
    batch = SamplingBatch.of(rows)
    for k, r in enumerate(rows):
        np.testing.assert_array_equal(batch.penalized(k, logits),
                                      penalized_logits(logits, r.params, r.prompt, r.generated, r.allowed))
    picked = batch.select([9, 2, 5])
    for j, k in enumerate([9, 2, 5]):
        np.testing.assert_array_equal(picked.penalized(j, logits), batch.penalized(k, logits))
        assert picked.uniform[j] == batch.uniform[k] and picked.rows[j] == batch.rows[k]


def test_a_grammar_that_allows_nothing_fails_its_row_alone() -> None:
    logits = np.zeros((1, 64), np.float32)
    nothing = np.zeros(2, np.int32)
    rows = [SampleRow(0, SamplingParams(temperature=1.0), np.random.default_rng(0)),
            SampleRow(0, SamplingParams(temperature=1.0), np.random.default_rng(1), allowed=nothing)]
    got = sample_batch(logits, SamplingBatch.of(rows))
    assert got[0].token in range(64) and isinstance(got[1], str) and "allows no token" in got[1]
