"""Verifying proposed tokens against the target's logits: standard speculative sampling.

For proposal d_i drawn from the draft's distribution q_i, the target's distribution p_i accepts it
with probability min(1, p_i(d_i) / q_i(d_i)); the first rejection is replaced by a draw from
norm(max(0, p_i - q_i)), and when every proposal stands, one more token comes from p_{k+1}. The tokens
then follow the target's distribution exactly (Leviathan et al. 2023, Chen et al. 2023). p and q are
both the output of kernels/sampling.py on the same history (bias, penalties over the prompt, the
generated tokens and the proposals before i, temperature, top-k/p, min-p), so every sampling option
applies to both alike. Greedy requests keep a proposal exactly when it is the target's argmax: the
tokens are those of decoding without speculation.

The host work is per proposed token (up to 2k + 1 distributions over the vocabulary a step), so each
distribution is built with as few passes over the vocabulary as its law allows: without truncation
(top-k, top-p, min-p) it stays unnormalized, since the accept test reads two entries and a draw
needs only the cumulative sum; the full normalized residual is built at a rejection only.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from ember.daemon.step.row_sampling import RowSampling
from ember.kernels.sampling import Choice, SamplingParams, choice_of, final_distribution, penalized_logits


@dataclass(frozen=True)
class Distribution:
    """Probabilities as nonnegative weights and their sum: P(t) = weights[t] / total."""
    weights: np.ndarray  # float64 [vocab]
    total: float

    def __getitem__(self, token: int) -> float:
        return float(self.weights[token]) / self.total

    def dense(self) -> np.ndarray:
        return self.weights / self.total

    @property
    def top(self) -> float:
        """The largest probability."""
        return float(self.weights.max()) / self.total


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # the draft's tokens, in order
    probs: list[Distribution]  # the draft's distribution each was drawn from (sampled requests only)


def verify(rows: np.ndarray, proposal: Proposal, seq: RowSampling) -> tuple[Choice, ...]:
    """The tokens a sequence (`seq`, its sampling) gets from one verification: `rows` are the target's logits [k + 1, vocab] after
    its last known token and after each of the k proposals. Draws use seq's own generator."""
    params = seq.params
    if params.plain_greedy and seq.constraint is None:  # one argmax over the rows: no per-row copy
        best = np.argmax(rows[: len(proposal.tokens) + 1], axis=1).tolist()
        n = next((i for i, (b, d) in enumerate(zip(best, proposal.tokens)) if b != d), len(proposal.tokens))
        return tuple(_choice(rows[i], best[i], seq) for i in range(n + 1))
    history = list(seq.generated)
    out: list[Choice] = []
    for i, token in enumerate(proposal.tokens + [None]):
        # the grammar's mask after the tokens this verification kept: a proposal it rules out has
        # p = 0 there, so it is rejected and the replacement is drawn from what the grammar allows
        penalized = processed_logits(rows[i], params, seq.prompt, history, seq.allowed(history[len(seq.generated):]))
        if params.greedy:
            best = int(np.argmax(penalized))
            out.append(_choice(penalized, best, seq))
            if best != token:
                break
        else:
            p = distribution(penalized, params)
            if token is None:  # every proposal stood: one more from the target alone
                out.append(_choice(penalized, _draw(p.weights, seq), seq))
                break
            q = proposal.probs[i]
            if seq.rng.random() * q[token] < p[token]:  # u < p/q without dividing by a tiny q
                out.append(_choice(penalized, token, seq))
            else:
                out.append(_choice(penalized, _draw(_residual(p.dense(), q.dense()), seq), seq))
                break
        history.append(out[-1].token)
    return tuple(out)


def draft_choice(logits: np.ndarray, seq: RowSampling, proposed: Seq[int]) -> tuple[int, Distribution | None]:
    """The draft's token after `proposed` ones, processed exactly as the target's row will be, and
    the distribution it was drawn from (None for greedy requests: the argmax needs none)."""
    if seq.params.plain_greedy and seq.constraint is None:
        return int(np.argmax(logits)), None
    penalized = processed_logits(logits, seq.params, seq.prompt, seq.generated + list(proposed),
                                 seq.allowed(proposed))  # proposed under the grammar, as they are verified
    if seq.params.greedy:
        return int(np.argmax(penalized)), None
    q = distribution(penalized, seq.params)
    return _draw(q.weights, seq), q


def draft_confidence(logits: np.ndarray) -> float:
    """The draft's top probability at a position, from its raw logits (softmax at temperature 1,
    whatever the request's options): on the demo pair it predicts acceptance alike for greedy and
    sampled requests (docs/speculative.md), and depends on nothing but the draft."""
    return 1.0 / float(np.exp(logits - logits.max(), dtype=np.float64).sum())


def processed_logits(logits: np.ndarray, params: SamplingParams, prompt: Seq[int], history: Seq[int],
                     allowed: np.ndarray | None = None) -> np.ndarray:
    """penalized_logits, or the row itself when no grammar, bias or penalty changes it (nothing writes
    to it)."""
    if params.changes_logits or allowed is not None:
        return penalized_logits(logits, params, prompt, history, allowed)
    return logits


def distribution(penalized: np.ndarray, params: SamplingParams) -> Distribution:
    """final_distribution's law. Without truncation: exp((logits - max) / T) left unnormalized, the
    same operations as final_distribution's first steps, in place (4 passes over the vocabulary
    instead of 12)."""
    vocab = penalized.shape[-1]
    if 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0:
        probs = final_distribution(penalized, params)
        return Distribution(probs, 1.0)
    weights = np.subtract(penalized, penalized.max(), dtype=np.float64)
    weights /= params.temperature
    with np.errstate(over="ignore", under="ignore"):
        np.exp(weights, out=weights)
    return Distribution(weights, float(weights.sum()))


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    # a rejection implies p(d) < q(d), hence some mass where p > q; only rounding can leave none
    return r / total if total > 0 else p


def _draw(weights: np.ndarray, seq: RowSampling) -> int:
    """A draw from the distribution proportional to `weights` by its inverse CDF: Generator.choice's
    algorithm without its checks of p, which cost as much again on a large vocabulary (a step here
    draws up to 2k + 1 times a sequence). The first entry whose cumulative sum passes u has a nonzero
    weight, since u < the total."""
    cdf = np.cumsum(weights)
    return int(np.searchsorted(cdf, seq.rng.random() * cdf[-1], side="right"))


def _choice(penalized: np.ndarray, token: int, seq: RowSampling) -> Choice:
    if not seq.wants_logprob and not seq.params.logprobs:  # nobody reads it (RowSampling.wants_logprob)
        return Choice(token, math.nan)
    return choice_of(penalized, token, seq.params.logprobs)
