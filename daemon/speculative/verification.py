"""Verifying proposed tokens against the target's logits: standard speculative sampling.

For proposal d_i drawn from the draft's distribution q_i, the target's distribution p_i accepts it
with probability min(1, p_i(d_i) / q_i(d_i)); the first rejection is replaced by a draw from
norm(max(0, p_i - q_i)), and when every proposal stands, one more token comes from p_{k+1}. The tokens
then follow the target's distribution exactly (Leviathan et al. 2023, Chen et al. 2023). p and q are
both the output of kernels/sampling.py on the same history (bias, penalties over the prompt, the
generated tokens and the proposals before i, temperature, top-k/p, min-p), so every sampling option
applies to both alike. Greedy requests keep a proposal exactly when it is the target's argmax: the
tokens are those of decoding without speculation.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from ember.daemon.engine.sequence import Sequence
from ember.kernels.sampling import Choice, choice_of, final_distribution, penalized_logits


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # the draft's tokens, in order
    probs: list[np.ndarray]  # the draft's distribution each was drawn from (sampled requests only)


def verify(rows: np.ndarray, proposal: Proposal, seq: Sequence) -> tuple[Choice, ...]:
    """The tokens seq gets from one verification: `rows` are the target's logits [k + 1, vocab] after
    its last known token and after each of the k proposals. Draws use seq's own generator."""
    params, history = seq.params, list(seq.generated)
    out: list[Choice] = []
    for i, token in enumerate(proposal.tokens + [None]):
        penalized = penalized_logits(rows[i], params, seq.prompt, history)
        if params.greedy:
            best = int(np.argmax(penalized))
            out.append(_choice(penalized, best, seq))
            if best != token:
                break
        else:
            p = final_distribution(penalized, params)
            if token is None:  # every proposal stood: one more from the target alone
                out.append(_choice(penalized, _draw(p, seq), seq))
                break
            q = proposal.probs[i]
            if seq.rng.random() * q[token] < p[token]:  # u < p/q without dividing by a tiny q
                out.append(_choice(penalized, token, seq))
            else:
                out.append(_choice(penalized, _draw(_residual(p, q), seq), seq))
                break
        history.append(out[-1].token)
    return tuple(out)


def draft_choice(logits: np.ndarray, seq: Sequence, proposed: Seq[int]) -> tuple[int, np.ndarray | None]:
    """The draft's token after `proposed` ones, processed exactly as the target's row will be, and
    the distribution it was drawn from (None for greedy requests: the argmax needs none)."""
    if seq.params.plain_greedy:
        return int(np.argmax(logits)), None
    penalized = penalized_logits(logits, seq.params, seq.prompt, seq.generated + list(proposed))
    if seq.params.greedy:
        return int(np.argmax(penalized)), None
    q = final_distribution(penalized, seq.params)
    return _draw(q, seq), q


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    # a rejection implies p(d) < q(d), hence some mass where p > q; only rounding can leave none
    return r / total if total > 0 else p


def _draw(probs: np.ndarray, seq: Sequence) -> int:
    """A draw from `probs` by its inverse CDF: Generator.choice's algorithm without its checks of p,
    which cost as much again on a large vocabulary (a step here draws up to 2k + 1 times a sequence).
    The first entry whose cumulative sum passes u has a nonzero probability, since u < the total."""
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, seq.rng.random() * cdf[-1], side="right"))


def _choice(penalized: np.ndarray, token: int, seq: Sequence) -> Choice:
    if not seq.wants_logprob and seq.params.plain_greedy:
        return Choice(token, math.nan)
    return choice_of(penalized, token, seq.params.logprobs)
