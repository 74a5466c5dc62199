"""NgramProposer: speculation without a draft model — prompt lookup decoding (Saxena 2023; vLLM's
"ngram" method, llama.cpp's lookup decoding). A sequence's last n tokens are looked up earlier in its
own context (prompt and generated tokens), and the tokens that followed their latest earlier
occurrence are proposed, longest n first.

A proposal costs a search over the context (a few microseconds: numpy over the sequence's tokens,
kept as an array that grows with them) instead of a draft model's passes, so speculation pays
wherever the output repeats its context: code edits, quoting a document, a summary that reuses
phrases, a model that loops. Where nothing matches, the sequence proposes nothing and the step
decodes it plainly (EngineCore speculates in a step only while a sequence has a match).

Verification is the same as a draft model's (verification.py). A proposal is a point mass (the draft
"distribution" puts all of its probability on the copied token), so a sampled request keeps a
proposal with probability p(token) and otherwise draws from p without it: the target's law exactly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import numpy as np

from ember.daemon.speculative.verification import Proposal
from ember.daemon.step.lookup import Lookup
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_work import WorkChunk

NGRAM = "ngram"  # the `draft` value that asks for this proposer (no model file)
MIN_NGRAM, MAX_NGRAM = 2, 4  # the n-grams looked up: the longest that matches wins


@dataclass(frozen=True)
class PointMass:
    """A draft distribution with all its probability on one token (verification reads q[token] and,
    at a rejection, q.dense())."""
    token: int
    vocab: int

    def __getitem__(self, token: int) -> float:
        return 1.0 if token == self.token else 0.0

    def dense(self) -> np.ndarray:
        out = np.zeros(self.vocab, np.float64)
        out[self.token] = 1.0
        return out


class _Context:
    """A sequence's tokens as a growing int32 array (appended to, never rebuilt)."""

    def __init__(self) -> None:
        self.tokens = np.empty(256, np.int32)
        self.length = 0

    def through(self, sampling: RowSampling, end: int) -> np.ndarray:
        """Its first `end` tokens (prompt, then generated)."""
        if end < self.length:  # a preempted sequence runs again from an earlier point
            self.length = end
        if end > self.length:
            prompt, generated = sampling.prompt, sampling.generated
            p = len(prompt)
            new = [*prompt[self.length:end], *generated[max(0, self.length - p):max(0, end - p)]]
            self.with_room(end - self.length)[self.length:end] = new
            self.length = end
        return self.tokens[:end]

    def with_room(self, extra: int) -> np.ndarray:
        """The whole array, with room for `extra` tokens after its known ones (a compiled burst writes
        the tokens it keeps there; through() copies them again from the sequence, the same values)."""
        if self.length + extra > self.tokens.size:
            grown = np.empty(max(self.length + extra, 2 * self.tokens.size), np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        return self.tokens


class NgramProposer:
    catches_up = False  # it reads the context itself: nothing to catch up on after plain steps

    def __init__(self, vocab: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.vocab, self.min_n, self.max_n = vocab, min_n, max_n
        self._contexts: WeakKeyDictionary[RowSampling, _Context] = WeakKeyDictionary()

    def propose(self, chunks: list[WorkChunk]) -> dict[int, Proposal]:
        """For each chunk with lookahead k whose sequence's last n tokens occurred before, up to k
        tokens copied from its context after their latest occurrence, keyed by the chunk's index (a
        chunk without a match is not in it: the executor samples it plainly)."""
        proposals = {}
        for i, c in enumerate(chunks):
            tokens = self.lookup(c.sampling, c.start + len(c.tokens), c.lookahead) if c.lookahead else []
            if tokens:
                probs = [] if c.sampling.params.greedy else [PointMass(t, self.vocab) for t in tokens]
                proposals[i] = Proposal(tokens, probs)  # type: ignore[arg-type]
        return proposals

    def burst_lookup(self, sampling: RowSampling, end: int, k: int, budget: int) -> Lookup:
        """What a compiled greedy burst of up to `budget` tokens needs to propose up to k tokens a round
        itself (ModelRunner.lookup_steps): this proposer's n-grams and the sequence's first `end`
        tokens, with room for the burst's."""
        context = self._context(sampling)
        context.through(sampling, end)
        return Lookup(k, self.min_n, self.max_n, context.with_room(budget), end)

    def has_match(self, sampling: RowSampling, end: int) -> bool:
        """Whether a sequence whose first `end` tokens are known would propose something."""
        return bool(self.lookup(sampling, end, 1))

    def lookup(self, sampling: RowSampling, end: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n of the first `end`
        tokens, for the longest n in [min_n, max_n] that occurs."""
        return continuation(self._context(sampling).through(sampling, end), self.min_n, self.max_n, k)

    def _context(self, sampling: RowSampling) -> _Context:
        context = self._contexts.get(sampling)
        if context is None:
            context = self._contexts[sampling] = _Context()
        return context


def continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The lookup on an array: for n from max_n down to min_n, the latest start s < len - n with
    tokens[s:s+n] equal to the last n, and then the k tokens after it, as if the text from there on
    repeated (past the array's end, the proposals themselves: a loop goes on)."""
    size = tokens.size
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = tokens[size - n:]
        # starts whose first token matches, leaving room for one following token before the tail's start
        starts = np.flatnonzero(tokens[: size - n] == tail[0])
        for j in range(1, n):
            if starts.size == 0:
                break
            starts = starts[tokens[starts + j] == tail[j]]
        if starts.size:  # the text since that occurrence, repeated: a loop of period `back` goes on
            back = size - n - int(starts[-1])
            out: list[int] = []
            for i in range(k):
                out.append(int(tokens[size - back + i]) if i < back else out[i - back])
            return out
    return []


def proposes(proposer: object, seqs: Sequence[tuple[RowSampling, int]]) -> bool:
    """Whether an n-gram proposer has something for any of (sampling, known tokens); any other
    proposer always may."""
    if not isinstance(proposer, NgramProposer):
        return True
    return any(proposer.has_match(s, end) for s, end in seqs)
