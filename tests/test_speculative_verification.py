"""Speculative sampling is lossless: on a small vocabulary with every sampling option on, the first two
tokens of draft-and-verify follow the target's distribution exactly (the joint law, computed, against
thousands of draws), and the same test rejects a wrong rule. The same holds without truncation
(verification's unnormalized distributions) and when the draft stops early by its own confidence
(DraftProposer's rule), while a stopping rule that reads the drawn token is seen to be wrong."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from ember.daemon.engine.sequence import Sequence
from ember.daemon.speculative import verification
from ember.daemon.speculative.verification import Distribution, Proposal, draft_choice, draft_confidence, verify
from ember.kernels.sampling import SamplingParams, final_distribution, penalized_logits
from ember.kernels.sampling_batch import sample

V, PROMPT, TRIALS = 8, [1, 3], 3000
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.92, min_p=0.04, repetition_penalty=1.3,
                        frequency_penalty=0.4, presence_penalty=0.2, logit_bias={2: 1.0, 5: -0.5})
UNTRUNCATED = SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={2: 1.0})
rng = np.random.default_rng(0)
TARGET = (rng.normal(size=V) * 1.5, rng.normal(size=(V, V)) * 1.5, rng.normal(size=(V, V, V)))  # after 0, 1, 2 tokens
# the draft: the target's logits plus noise, as a smaller model of the same data would be
DRAFT = (TARGET[0] + rng.normal(size=V), TARGET[1] + rng.normal(size=(V, V)))


def target_law(params: SamplingParams) -> np.ndarray:
    """P(t1, t2): the target's distribution of the first two tokens, with the same processing."""
    p1 = final_distribution(penalized_logits(TARGET[0], params, PROMPT, []), params)
    return np.stack([p1[a] * final_distribution(penalized_logits(TARGET[1][a], params, PROMPT, [a]), params)
                     for a in range(V)])


def always(row2: np.ndarray, q2: Distribution, d2: int) -> bool:
    return True


Second = Callable[[np.ndarray, Distribution, int], bool]


def speculated(seed: int, params: SamplingParams, second: Second = always) -> tuple[int, int]:
    """t1, t2 from proposing one or two tokens and verifying them: d2, drawn from the draft's q2
    (processed from the draft's logits row2), is proposed when second(row2, q2, d2) says so. When verification yields only t1, t2 comes from the
    next step, which samples the target after t1."""
    seq = Sequence(PROMPT, 10, params, seed=seed)
    d1, q1 = draft_choice(DRAFT[0], seq.sampling, [])
    d2, q2 = draft_choice(DRAFT[1][d1], seq.sampling, [d1])
    if second(DRAFT[1][d1], q2, d2):
        rows = np.stack([TARGET[0], TARGET[1][d1], TARGET[2][d1, d2]]).astype(np.float32)
        block = verify(rows, Proposal([d1, d2], [q1, q2]), seq.sampling)
    else:
        block = verify(np.stack([TARGET[0], TARGET[1][d1]]).astype(np.float32), Proposal([d1], [q1]), seq.sampling)
    t1 = block[0].token
    t2 = block[1].token if len(block) > 1 else sample(TARGET[1][t1], params, seq.rng, PROMPT, [t1]).token
    return t1, t2


def chi_square_z(params: SamplingParams = PARAMS, second: Second = always) -> float:
    counts = np.zeros((V, V))
    for seed in range(TRIALS):
        counts[speculated(seed, params, second)] += 1
    expected = target_law(params) * TRIALS
    if counts[expected == 0].sum():
        return math.inf  # a pair the target can never sample came out
    cells = expected > 0
    stat, df = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()), int(cells.sum()) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))  # Wilson-Hilferty: ~N(0, 1)


def test_draft_and_verify_follow_the_target_law() -> None:
    assert chi_square_z() < 4.0


def test_a_wrong_rule_is_seen(monkeypatch) -> None:
    """The classic mistake: after a rejection, draw again from p instead of norm(max(0, p - q)): tokens
    the draft over-proposes come out too often (z = 0.02 for the right rule, 17 for this one at 4000
    draws, when this test was written)."""
    monkeypatch.setattr(verification, "_residual", lambda p, q: p)
    assert chi_square_z() > 6.0


def test_untruncated_distributions_follow_the_target_law(monkeypatch) -> None:
    """Without top-k/p and min-p, verification keeps distributions unnormalized: the law is the same,
    and the wrong residual is seen there too."""
    assert chi_square_z(UNTRUNCATED) < 4.0
    monkeypatch.setattr(verification, "_residual", lambda p, q: p)
    assert chi_square_z(UNTRUNCATED) > 6.0


# the draft's confidence at position 2 is 0.25 to 0.72 over d1 here: 0.55 stops half the time
MIN_PROB = 0.55


@pytest.mark.slow
def test_stopping_by_the_drafts_confidence_keeps_the_law() -> None:
    """DraftProposer's rule: whether to propose at a position depends on the draft's logits there (a
    function of the tokens before it), never on the token drawn; here draft_confidence itself, and
    the top of the processed q."""
    for params in (PARAMS, UNTRUNCATED):
        assert chi_square_z(params, lambda row2, q2, d2: draft_confidence(row2) >= MIN_PROB) < 4.0
        assert chi_square_z(params, lambda row2, q2, d2: q2.top >= MIN_PROB) < 4.0


def test_a_stopping_rule_that_reads_the_drawn_token_is_seen() -> None:
    """The mistake the rule avoids: dropping a proposal by its own probability q(d). What is then
    verified against q2 was drawn from q2 cut to its likely tokens: those come out too often."""
    for params in (PARAMS, UNTRUNCATED):
        assert chi_square_z(params, lambda row2, q2, d2: q2[d2] >= 0.5 * q2.top) > 6.0


def test_greedy_keeps_exactly_the_argmax_prefix() -> None:
    params = SamplingParams(repetition_penalty=1.5)
    seq = Sequence(PROMPT, 10, params)
    rows = np.stack([TARGET[0], TARGET[1][0], TARGET[2][0, 0]]).astype(np.float32)
    best = [int(np.argmax(penalized_logits(TARGET[0], params, PROMPT, [])))]
    block = verify(rows, Proposal([best[0], (best[0] + 1) % V], []), seq.sampling)
    assert [c.token for c in block][0] == best[0] and len(block) == 2
    assert block[1].token == int(np.argmax(penalized_logits(TARGET[1][0], params, PROMPT, best)))
