"""SamplingBatch: how a step's logits rows are sampled, as arrays — what every sampler reads, so that the
host's, the numba kernels' and the native kernels' (inside a captured graph) draw the same tokens and
none of them sees a generator, a token history or a grammar object.

A batch holds, per row: its logits row, its parameters (temperature, top-k/p, min-p, repetition
penalty), whether it is greedy, what it reports (the chosen token's logprob, top alternatives), its
grammar's mask words, and the one uniform number its draw uses, taken from the request's own
generator when the batch is built: exactly the number numpy's `Generator.choice(p=...)` would draw, so
a seeded request gives the same tokens as it always did. Per (row, token id) it holds the sparse logit
adjustments that bias and penalties make from the row's history (steps 1-3 of kernels/sampling.py).

Built once per sampled step on the host (`of`); `sample_batch` is the host sampler over it, `sample`
the same for one row of logits.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ember.kernels.sampling import (Choice, SampleRow, SamplingParams, allowed_tokens, choice_of, distribution,
                                    history_window)

ALL_TOKENS = np.uint32(0xFFFFFFFF)  # a mask word that allows its 32 tokens


@dataclass(frozen=True)
class SamplingBatch:
    rows: np.ndarray  # int64 [m]: the logits row each samples
    greedy: np.ndarray  # bool [m]: temperature 0 or top_k 1 (argmax of the adjusted logits)
    temperature: np.ndarray  # float64 [m] (0 where greedy by temperature)
    top_k: np.ndarray  # int64 [m] (0: no limit)
    top_p: np.ndarray  # float64 [m]
    min_p: np.ndarray  # float64 [m]
    penalty: np.ndarray  # float32 [m]: the repetition penalty (1: off)
    logprob: np.ndarray  # bool [m]: the chosen token's logprob is wanted (else NaN)
    top_n: np.ndarray  # int64 [m]: top alternatives reported
    uniform: np.ndarray  # float64 [m]: the draw's number in [0, 1) (0 where greedy: none is drawn)
    # the adjustments, one entry per (row, token id), sorted by row then id: applied as bias, then the
    # repetition penalty where `repeated`, then `sub` (frequency and presence) subtracted
    entry_row: np.ndarray  # int64 [e]
    entry_starts: np.ndarray  # int64 [m + 1]: row k's entries are entry_starts[k] .. entry_starts[k + 1] - 1
    ids: np.ndarray  # int64 [e]
    bias: np.ndarray  # float32 [e]
    repeated: np.ndarray  # bool [e]
    sub: np.ndarray  # float64 [e]
    biased: np.ndarray  # bool [m]: some of the row's entries carry a bias
    subtracts: np.ndarray  # bool [m]: some of the row's entries subtract frequency and presence penalties
    # grammar masks: uint32 [m, words], bit t % 32 of word t // 32 set for an allowed token t; rows
    # without a grammar all ones (every token, also past the words), rows with one allow nothing past
    # their words; None when no row has a grammar
    words: np.ndarray | None
    constrained: np.ndarray  # bool [m]: the row has a grammar

    @classmethod
    def of(cls, rows: Sequence[SampleRow]) -> SamplingBatch:
        """The rows' arrays; draws each sampled row's uniform number from its generator, in order."""
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        return cls(rows=np.array([r.row for r in rows], np.int64), greedy=np.array(greedy, bool),
                   temperature=np.array([p.temperature for p in params], np.float64),
                   top_k=np.array([p.top_k for p in params], np.int64),
                   top_p=np.array([p.top_p for p in params], np.float64),
                   min_p=np.array([p.min_p for p in params], np.float64),
                   penalty=np.array([p.repetition_penalty for p in params], np.float32),
                   logprob=np.array([r.logprob for r in rows], bool),
                   top_n=np.array([p.logprobs for p in params], np.int64),
                   biased=np.array([bool(p.logit_bias) for p in params], bool),
                   subtracts=np.array([_subtracts(r.params, r.generated) for r in rows], bool),
                   uniform=np.array([0.0 if g else r.rng.random() for g, r in zip(greedy, rows, strict=True)],
                                    np.float64),
                   **_adjustments(rows), **_masks(rows))

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def n_entries(self) -> int:
        return len(self.ids)

    def entries_of(self, k: int) -> slice:
        """Row k's adjustment entries."""
        return slice(int(self.entry_starts[k]), int(self.entry_starts[k + 1]))

    def select(self, ks: Sequence[int], rows: Sequence[int] | None = None) -> SamplingBatch:
        """The batch of rows ks (in that order), their uniform numbers kept; `rows`: new logits row
        indices for them (a sampler that gathered them first)."""
        ks = np.asarray(ks, np.int64)
        slices = [self.entries_of(int(k)) for k in ks]
        take = np.concatenate([np.arange(s.start, s.stop) for s in slices]) if slices else np.zeros(0, np.int64)
        counts = [s.stop - s.start for s in slices]
        renumber = np.repeat(np.arange(len(ks)), counts)
        return SamplingBatch(rows=self.rows[ks] if rows is None else np.asarray(rows, np.int64),
                             greedy=self.greedy[ks], temperature=self.temperature[ks], top_k=self.top_k[ks],
                             top_p=self.top_p[ks], min_p=self.min_p[ks], penalty=self.penalty[ks],
                             logprob=self.logprob[ks], top_n=self.top_n[ks], uniform=self.uniform[ks],
                             entry_row=renumber.astype(np.int64), entry_starts=_starts(counts), ids=self.ids[take],
                             bias=self.bias[take], repeated=self.repeated[take], sub=self.sub[take],
                             biased=self.biased[ks], subtracts=self.subtracts[ks],
                             words=None if self.words is None or not self.constrained[ks].any() else self.words[ks],
                             constrained=self.constrained[ks])

    def mask_words(self, n_words: int) -> np.ndarray:
        """Every row's mask as exactly n_words uint32 words (a vocabulary's, or a device buffer's): its
        own words cut or padded, with all ones past them for a row without a grammar (every token) and
        zeros for a row with one (no token past its words)."""
        words = np.where(self.constrained[:, None], np.uint32(0), ALL_TOKENS).repeat(n_words, axis=1)
        if self.words is not None:
            given = min(n_words, self.words.shape[1])
            words[:, :given] = self.words[:, :given]
        return words.astype(np.uint32, copy=False)

    def masked(self, k: int, logits: np.ndarray) -> np.ndarray:
        """Step 0: row k's logits with -inf where its grammar rules a token out (a new float32 array).
        ValueError when its grammar allows no token."""
        if not self.constrained[k]:
            return np.array(logits, dtype=np.float32)
        assert self.words is not None
        mask = allowed_tokens(self.words[k].view(np.int32), logits.shape[-1])
        return np.where(mask, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def penalized(self, k: int, logits: np.ndarray) -> np.ndarray:
        """Steps 0-3 on row k's logits, as kernels/sampling.penalized_logits computes them (a new array)."""
        out = self.masked(k, logits)
        e = self.entries_of(k)
        if e.start == e.stop:
            return out
        ids = self.ids[e]
        if self.biased[k]:
            out[ids] += self.bias[e]
        rep = ids[self.repeated[e]]
        if rep.size:
            vals = out[rep]
            out[rep] = np.where(vals > 0, vals / self.penalty[k], vals * self.penalty[k])
        if self.subtracts[k]:
            out[ids] = out[ids] - self.sub[e]  # in float64, then rounded, as the host's penalties are
        return out

    def plain(self, k: int) -> bool:
        """Row k is its logits' argmax and reports nothing: no pass over the vocabulary beyond it."""
        e = self.entries_of(k)
        return bool(self.greedy[k] and not self.logprob[k] and not self.top_n[k] and not self.constrained[k]
                    and e.start == e.stop)


def sample_batch(logits: np.ndarray, batch: SamplingBatch) -> list[Choice | str]:
    """The host sampler: each of the batch's rows of host `logits` [n, vocab] sampled as it asks, a
    Choice, or why that row's sampling failed (one row's failure is its sequence's alone)."""
    out: list[Choice | str] = []
    for k in range(batch.size):
        try:
            out.append(sample_row(logits[batch.rows[k]], batch, k))
        except (ValueError, FloatingPointError, ArithmeticError) as e:
            out.append(f"sampling failed: {type(e).__name__}: {e}")
    return out


def sample_row(logits: np.ndarray, batch: SamplingBatch, k: int) -> Choice:
    """Row k of `batch` from its logits row (kernels/sampling.py's steps 0-9)."""
    if batch.plain(k):
        return Choice(int(np.argmax(logits)), math.nan)
    penalized = batch.penalized(k, logits)
    law = (float(batch.temperature[k]), int(batch.top_k[k]), float(batch.top_p[k]), float(batch.min_p[k]))
    if batch.greedy[k]:
        token = int(np.argmax(penalized))
    elif batch.constrained[k] and (support := np.flatnonzero(penalized > -np.inf)).size * 4 < penalized.size:
        # a grammar's few allowed tokens: the distribution over them alone, whose cumulative sums are
        # the full one's without its zeros, so the one uniform number picks the same token
        token = int(support[draw(distribution(penalized[support], *law), float(batch.uniform[k]))])
    else:
        token = draw(distribution(penalized, *law), float(batch.uniform[k]))
    if not batch.logprob[k] and not batch.top_n[k]:  # nobody reads it: no pass over the vocabulary for it
        return Choice(token, math.nan)
    return choice_of(penalized, token, int(batch.top_n[k]))


def draw(probs: np.ndarray, uniform: float) -> int:
    """The token numpy's Generator.choice(probs.size, p=probs) picks when its one random number is
    `uniform`: the first whose normalised cumulative sum exceeds it."""
    if np.isnan(probs.sum()):
        raise ValueError("probabilities contain NaN")
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(uniform, side="right"))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, prompt: Sequence[int] = (),
           generated: Sequence[int] = (), logprob: bool = True, allowed: np.ndarray | None = None) -> Choice:
    """Pick the next token from one logits row; `rng` is the request's own generator, so a seeded request
    gives the same tokens whatever else runs beside it. Without `logprob` (and no top alternatives asked
    for) the logprob is NaN. ValueError where sampling fails."""
    batch = SamplingBatch.of([SampleRow(0, params, rng, prompt, generated, logprob, allowed)])
    return sample_row(np.asarray(logits), batch, 0)


def _adjustments(rows: Sequence[SampleRow]) -> dict[str, np.ndarray]:
    """Steps 1-3 of each row as sparse entries merged per (row, token id)."""
    parts = [_row_adjustments(r.params, r.prompt, r.generated) for r in rows]
    counts = [len(p[0]) for p in parts]
    if not any(counts):
        return dict(entry_row=_NONE[0], entry_starts=np.zeros(len(rows) + 1, np.int64), ids=_NONE[0], bias=_NONE[1],
                    repeated=_NONE[2], sub=_NONE[3])
    if len(parts) == 1:
        ids, bias, repeated, sub = parts[0]
        return dict(entry_row=np.zeros(len(ids), np.int64), entry_starts=np.array([0, len(ids)], np.int64), ids=ids,
                    bias=bias, repeated=repeated, sub=sub)
    ids, bias, repeated, sub = (np.concatenate(c) for c in zip(*parts, strict=True))
    return dict(entry_row=np.repeat(np.arange(len(rows), dtype=np.int64), counts), entry_starts=_starts(counts),
                ids=ids, bias=bias, repeated=repeated, sub=sub)


_NONE = (np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, bool), np.zeros(0, np.float64))
for _empty in _NONE:
    _empty.flags.writeable = False  # shared by every batch without adjustments


def _row_adjustments(p: SamplingParams, prompt: Sequence[int], generated: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One row's entries (ids ascending): bias, repeated?, and what frequency and presence subtract."""
    repeats = p.repetition_penalty != 1.0
    counting = _subtracts(p, generated)
    if not (p.logit_bias or repeats or counting):
        return _NONE
    seen = np.unique(history_window(prompt, generated, p)) if repeats else _NONE[0]
    if not p.logit_bias and not counting:  # the repetition penalty alone: the common case
        return seen, np.zeros(len(seen), np.float32), np.ones(len(seen), bool), np.zeros(len(seen))
    bias_ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
    if counting:
        counted, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
    else:
        counted, counts = _NONE[0], _NONE[0]
    ids = np.unique(np.concatenate([bias_ids, seen, counted]))
    bias = np.zeros(len(ids), np.float32)
    bias[np.searchsorted(ids, bias_ids)] = np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
    repeated = np.zeros(len(ids), bool)
    repeated[np.searchsorted(ids, seen)] = True
    sub = np.zeros(len(ids), np.float64)
    sub[np.searchsorted(ids, counted)] = counts * p.frequency_penalty + p.presence_penalty
    return ids, bias, repeated, sub


def _subtracts(p: SamplingParams, generated: Sequence[int]) -> bool:
    """Frequency or presence penalties apply to the row: it asks for them and has generated tokens."""
    return bool((p.frequency_penalty or p.presence_penalty) and len(generated))


def _starts(counts: Sequence[int]) -> np.ndarray:
    return np.array([0, *itertools.accumulate(counts)], np.int64)


def _masks(rows: Sequence[SampleRow]) -> dict[str, np.ndarray | None]:
    constrained = np.array([r.allowed is not None for r in rows], bool)
    if not constrained.any():
        return dict(words=None, constrained=constrained)
    width = max(len(r.allowed) for r in rows if r.allowed is not None)
    words = np.full((len(rows), width), ALL_TOKENS, np.uint32)
    for k, r in enumerate(rows):
        if r.allowed is not None:
            words[k] = 0
            words[k, : len(r.allowed)] = np.ascontiguousarray(r.allowed, np.int32).view(np.uint32)
    return dict(words=words, constrained=constrained)
