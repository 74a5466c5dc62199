"""SoloDecode: one request's generation with its own KV cache, advanced one forward pass per step().

The engine interleaves many of these (round robin), so each step is small: a prompt chunk or one
token. It computes exactly what Model.generate computes (same chunking, same sampler, same use of the
request's random generator: tests hold the two equal) and additionally hands out what the daemon
streams: the sampler's Choice (log-probabilities) and the logits the token was drawn from.
Continuous batching (daemon/batch_engine.py) will replace it behind the engine.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ember.daemon.runtime import KV_BLOCK, PREFILL_CHUNK, Model
from ember.daemon.step_batch import StepBatch
from ember.kernels.sampling import Choice, SamplingParams, sample


@dataclass(frozen=True)
class Step:
    token: int
    choice: Choice
    logits: np.ndarray  # [vocab] float32, the raw model output this token was sampled from
    finish: str | None  # "stop" (eos / stop id), "length" (max_tokens / context full) or None


class SoloDecode:
    def __init__(self, model: Model, prompt: Sequence[int], max_tokens: int, params: SamplingParams,
                 seed: int | None = None, stop_ids: Iterable[int] = (), ignore_eos: bool = False) -> None:
        self._model = model
        self._prompt = list(prompt)
        self._params = params
        self._rng = np.random.default_rng(seed)
        self._stop = set(stop_ids) | (set() if ignore_eos else set(model.tokenizer.eos_ids))
        self._max_tokens = max_tokens
        self._capacity = min(len(self._prompt) + max_tokens, model.config.context_length)
        self._prefilled = 0  # prompt tokens whose K/V are in the cache
        self._pos = len(self._prompt)  # position of the next token to run
        self._pending: int | None = None  # sampled but not yet run through the model
        self.generated: list[int] = []
        # Model.generate yields nothing when there is no room: no token, no forward pass
        self.finish: str | None = "length" if self._capacity <= len(self._prompt) else None
        n_blocks = -(-self._capacity // KV_BLOCK)
        self._table = list(range(n_blocks))
        self._cache = model.net.new_cache(n_blocks, KV_BLOCK, model.kv_dtype) if self.finish is None else None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def prefilling(self) -> bool:
        return self._prefilled < len(self._prompt)

    def step(self) -> Step | None:
        """One forward pass: the next prompt chunk (None until the prompt is read; the last chunk also
        samples the first token) or the last sampled token, then the next token."""
        if self.done:
            raise RuntimeError("step() after the generation finished")
        if self.prefilling:
            start = self._prefilled
            chunk = self._prompt[start : start + PREFILL_CHUNK]
            logits = self._forward(chunk, start)
            self._prefilled += len(chunk)
            if self.prefilling:
                return None
        else:
            assert self._pending is not None
            logits = self._forward([self._pending], self._pos)
            self._pos += 1
        return self._sample(logits[0])

    def close(self) -> None:
        """Free the KV cache (a cancelled request's memory goes back now, not at garbage collection)."""
        self._cache = None
        if self.finish is None:
            self.finish = "cancelled"

    def _sample(self, logits: np.ndarray) -> Step:
        choice = sample(logits, self._params, self._rng, self._prompt, self.generated)
        token = choice.token
        self.generated.append(token)
        if token in self._stop:
            self.finish = "stop"
        elif len(self.generated) >= self._max_tokens or self._pos + 1 >= self._capacity:
            self.finish = "length"
        else:
            self._pending = token
        if self.finish is not None:
            self._cache = None
        return Step(token, choice, logits, self.finish)

    def _forward(self, tokens: Sequence[int], start: int) -> np.ndarray:
        net = self._model.net
        batch = StepBatch.build([(tokens, start, self._table)], KV_BLOCK)
        return net.ops.to_numpy(net.forward(batch, self._cache))
