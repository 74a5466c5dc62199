"""RowSampling: how one sequence's next tokens are drawn — all a runner (or a verifier) needs of it to
sample a logits row: its parameters, its generator, the tokens its penalties look back over, its
stop ids. The engine's Sequence owns one and keeps its token lists current; the runner never sees
the Sequence itself (its blocks, status, scheduling)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ember.kernels.sampling import SamplingParams


@dataclass(eq=False)
class RowSampling:
    params: SamplingParams
    rng: np.random.Generator
    prompt: Sequence[int]
    generated: list[int]  # the sequence's own list: what the engine appends shows here
    stop_ids: frozenset[int] = frozenset()
    wants_logprob: bool = False  # compute each chosen token's logprob (else Choice.logprob is NaN)

    @property
    def last_token(self) -> int:
        """The newest token: the next decode step's input."""
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def plain_greedy(self) -> bool:
        """It takes its logits' argmax and asks for nothing else (no penalties, no logprobs)."""
        return not self.wants_logprob and self.params.plain_greedy
