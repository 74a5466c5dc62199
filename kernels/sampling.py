"""Choosing the next token from a row of logits, with every option users expect.

Order of operations (documented in docs/sampling.md; the same as vLLM / HF transformers):
  0. grammar           tokens a request's grammar does not allow next get -inf (constrained decoding)
  1. logit_bias        logits[id] += bias
  2. repetition        llama.cpp / CTRL multiplicative penalty on every token seen in the window
                       (prompt included by default): logit / p if logit > 0 else logit * p
  3. frequency and     OpenAI additive penalties over the tokens generated so far:
     presence          logit -= count * frequency_penalty + (count > 0) * presence_penalty
  4. greedy            temperature 0 or top_k 1: argmax, nothing below applies
  5. temperature       logits / T, then softmax
  6. top_k             keep the k most probable
  7. top_p             keep the smallest set whose probability reaches p
  8. min_p             drop tokens below min_p x the best probability
  9. draw              from the renormalised distribution with the request's own generator
Logprobs are log-softmax of the logits after steps 1-3 (what the model, penalised, believes), before
temperature and truncation, so they do not depend on sampling settings.

This module holds the law: the parameters, steps 0-3 (penalized_logits) and 5-8 (final_distribution),
logprobs (choice_of). kernels/sampling_batch.py turns a step's rows into arrays and samples them on
the host; the GPU samplers read the same arrays.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0  # beyond it every distribution is uniform to float32's precision anyway
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # x100 either way: far past any use, finite


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    repetition_window: int = 64  # tokens looked back (-1 = whole context), as llama.cpp's last_n
    penalize_prompt: bool = True  # the repetition window covers prompt tokens too
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int = 0  # top-n alternatives reported with each token (0 = only the chosen one's, if asked)

    def __post_init__(self) -> None:
        # every bound below also refuses NaN (comparisons with NaN are false) and infinities; within
        # them the arithmetic below cannot overflow (see final_distribution for tiny temperatures)
        _check(0.0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0: greedy), got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1: off), "
               f"got {self.repetition_penalty}")
        _check(self.repetition_window >= -1, f"repetition_window must be >= -1, got {self.repetition_window}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for token, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, f"logit_bias for token {token} must be in [-100, 100], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def changes_logits(self) -> bool:
        """Whether bias or a penalty changes the logits before anything else (penalized_logits)."""
        return bool(self.logit_bias or self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits first: the token is the row's argmax."""
        return self.greedy and not self.changes_logits and not self.logprobs

    def check_vocab(self, vocab: int) -> None:
        for token in self.logit_bias:
            _check(0 <= int(token) < vocab, f"logit_bias token {token} is outside the vocabulary [0, {vocab})")


@dataclass(frozen=True)
class SampleRow:
    """One logits row to sample, as a SamplingBatch is built from it: its parameters, the request's own
    generator, and the history penalties look at."""
    row: int
    params: SamplingParams
    rng: np.random.Generator
    prompt: Sequence[int] = ()
    generated: Sequence[int] = ()
    logprob: bool = True
    allowed: np.ndarray | None = None  # the grammar's mask (allowed_tokens' words); None: every token


@dataclass(frozen=True)
class Choice:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most probable first


def allowed_tokens(words: np.ndarray, vocab: int) -> np.ndarray:
    """A grammar's mask as booleans over `vocab` tokens: bit t % 32 of int32 word t // 32 is token t
    (llguidance's layout); tokens past the words are not allowed. ValueError when none is."""
    bits = np.unpackbits(np.ascontiguousarray(words, np.int32).view(np.uint8), bitorder="little")[:vocab]
    if not bits.any():
        raise ValueError("the grammar allows no token here")
    if bits.size == vocab:
        return bits.view(bool)  # 0 and 1 bytes: numpy's booleans as they are
    out = np.zeros(vocab, bool)
    out[: bits.size] = bits
    return out


def penalized_logits(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int],
                     allowed: np.ndarray | None = None) -> np.ndarray:
    """Steps 0-3: the logits after the grammar's mask (`allowed`: its words), bias and penalties (a
    new float32 array)."""
    if allowed is None:
        out = np.array(logits, dtype=np.float32)
    else:  # the copy and the mask in one pass
        mask = allowed_tokens(allowed, logits.shape[-1])
        out = np.where(mask, logits, np.float32(-np.inf)).astype(np.float32, copy=False)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), np.int64)
        out[ids] += np.fromiter(params.logit_bias.values(), np.float32)
    if params.repetition_penalty != 1.0:
        seen = history_window(prompt, generated, params)
        if seen.size:
            ids = np.unique(seen)
            vals = out[ids]
            out[ids] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and len(generated):
        ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
        out[ids] -= counts * params.frequency_penalty + params.presence_penalty
    return out


def history_window(prompt: Sequence[int], generated: Sequence[int], params: SamplingParams) -> np.ndarray:
    """The tokens the repetition penalty looks back over."""
    history = np.asarray(generated, np.int64)
    if params.penalize_prompt:
        history = np.concatenate([np.asarray(prompt, np.int64), history])
    if params.repetition_window == -1:
        return history
    return history[max(0, len(history) - params.repetition_window):]


def final_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Steps 5-8 on penalised logits: the probabilities draws come from (float64, sums to 1)."""
    return distribution(logits, params.temperature, params.top_k, params.top_p, params.min_p)


def distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """final_distribution from the parameters themselves (a SamplingBatch row's)."""
    # subtract the max before dividing: every exponent is <= 0 and the best one is exactly 0, so no
    # temperature > 0, however small, can overflow (a tiny one gives the one-hot greedy distribution)
    shifted = logits.astype(np.float64)
    shifted -= shifted.max()
    with np.errstate(over="ignore"):  # -inf is the intended result there: exp gives 0
        probs = np.exp(shifted / temperature)
    probs /= probs.sum()
    keep = np.ones(probs.size, bool)
    if 0 < top_k < probs.size or top_p < 1.0:
        keep[:] = False
        keep[_top_kept(probs, top_k if top_k < probs.size else 0, top_p)] = True
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def _top_kept(probs: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The tokens top-k (0: off) and top-p keep: the first min(top_k, cut) of the vocabulary stably
    sorted by descending probability, where cut is the smallest prefix whose sum reaches top_p.

    Sorting the whole vocabulary cost more than the rest of sampling together (0.3-1 ms over 8192
    entries, and speculative decoding builds 2k + 1 distributions a step), while the kept tokens
    are usually a few dozen. So only candidates are sorted: every token at least as probable as
    the top_k-th (a linear-time partition), or without top-k every token at least 1e-3 (then 1e-6)
    times as probable as the best. Either way they are all the tokens above a value, so their stable
    order is the full sort's first entries, with the same prefix sums (cumsum adds in order) and the
    same cut, as long as the cut falls among them; where it does not, the next set is tried, and at
    last the whole vocabulary."""
    if top_k:  # the kept tokens are at most the first top_k: these candidates always hold them
        floors = [float(np.partition(probs, probs.size - top_k)[probs.size - top_k])]
    else:
        floors = [float(probs.max()) * 1e-3, float(probs.max()) * 1e-6, 0.0]
    for i, floor in enumerate(floors):
        candidates = np.flatnonzero(probs >= floor) if floor > 0.0 else np.arange(probs.size)
        order = candidates[np.argsort(-probs[candidates], kind="stable")]
        cut = len(order)
        if top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1  # smallest set reaching p
        if top_k or cut <= len(order) or i == len(floors) - 1:
            return order[: min(top_k or probs.size, cut)]
    raise AssertionError("unreachable: the last floor returns")


def choice_of(penalized: np.ndarray, token: int, top_n: int) -> Choice:
    """The Choice of `token` from penalised logits: its logprob and the top_n alternatives."""
    # log-softmax without materializing it: exp in float32 (arguments <= 0, relative error ~1e-7),
    # summed in float64; every token's value only when top alternatives are asked for
    best = penalized.max()
    log_total = float(np.log(np.exp(penalized - best).sum(dtype=np.float64)))
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        ids = np.argpartition(-penalized, top_n - 1)[:top_n]
        ids = ids[np.argsort(-penalized[ids], kind="stable")]
        # a token the grammar rules out (-inf) is no alternative
        top = tuple((int(t), float(penalized[t]) - float(best) - log_total) for t in ids if penalized[t] > -np.inf)
    return Choice(token, float(penalized[token]) - float(best) - log_total, top)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
