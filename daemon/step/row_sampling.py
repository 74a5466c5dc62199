"""RowSampling: how one sequence's next tokens are drawn — all a runner (or a verifier) needs of it to
sample a logits row: its parameters, its generator, the tokens its penalties look back over, its
stop ids, and the grammar its tokens must follow, if any. The engine's Sequence owns one and keeps its
token lists current; the runner never sees the Sequence itself (its blocks, status, scheduling)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ember.kernels.sampling import SamplingParams


class TokenConstraint(Protocol):
    """Which tokens may come next (constrained decoding: daemon/text/grammar.py). The engine accepts
    each token the sequence keeps; a sampler asks for the mask after those and the tokens it has
    drawn but not handed back yet (a decode burst's, a verification's accepted proposals, a draft's)."""

    def allowed(self, pending: Sequence[int] = ()) -> np.ndarray:
        """The tokens allowed after the accepted ones and `pending`: int32 words, bit t % 32 of word
        t // 32 set for token t. ValueError when `pending` breaks the grammar or it is in error."""
        ...

    def allows(self, token: int, pending: Sequence[int] = ()) -> bool:
        """Whether `token` may come after the accepted tokens and `pending` (no mask computed)."""
        ...

    def accept(self, token: int) -> None:
        """The sequence kept `token` (a token the grammar does not allow puts it in error: `failed`)."""
        ...

    @property
    def done(self) -> bool:
        """No token but an end of text may follow: the sequence is complete."""
        ...

    @property
    def failed(self) -> str:
        """Why the grammar is in error ("" while it is not)."""
        ...


@dataclass(eq=False)
class RowSampling:
    params: SamplingParams
    rng: np.random.Generator
    prompt: Sequence[int]
    generated: list[int]  # the sequence's own list: what the engine appends shows here
    stop_ids: frozenset[int] = frozenset()
    wants_logprob: bool = False  # compute each chosen token's logprob (else Choice.logprob is NaN)
    constraint: TokenConstraint | None = None  # the grammar its tokens follow (set when the engine takes it)
    device_logits: bool = False  # its kept logits rows stay on the model's device (a device array each)

    @property
    def last_token(self) -> int:
        """The newest token: the next decode step's input."""
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def plain_greedy(self) -> bool:
        """It takes its logits' argmax and asks for nothing else (no penalties, no logprobs, no grammar)."""
        return not self.wants_logprob and self.params.plain_greedy and self.constraint is None

    def allowed(self, pending: Sequence[int] = ()) -> np.ndarray | None:
        """Its grammar's mask after its tokens and `pending` (None: no grammar, every token)."""
        return None if self.constraint is None else self.constraint.allowed(pending)
