"""Choosing the next token from a row of logits: greedy, temperature, top-k, top-p and min-p.

Order of operations (as llama.cpp's default chain): temperature 0 -> argmax; otherwise top-k, then
softmax at the temperature, then top-p (smallest set whose mass reaches p), then min-p (drop tokens
below min_p x the best probability), renormalise, draw with the request's own generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return int(np.argmax(logits))
    ids = np.arange(logits.size)
    if 0 < params.top_k < logits.size:
        ids = np.argpartition(logits, -params.top_k)[-params.top_k :]
    scaled = logits[ids].astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    ids, probs = ids[order], probs[order]
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        ids, probs = ids[:keep], probs[:keep]
    if params.min_p > 0.0:
        keep_mask = probs >= params.min_p * probs[0]
        ids, probs = ids[keep_mask], probs[keep_mask]
    return int(ids[rng.choice(ids.size, p=probs / probs.sum())])
