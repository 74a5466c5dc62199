"""DraftChunk: what a speculative proposer reads of one chunk of the step (the engine's plan, as plain
data): its tokens and where they go, how many tokens to propose after it, and how its sequence
samples."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ember.daemon.step.row_sampling import RowSampling


@dataclass(frozen=True)
class DraftChunk:
    tokens: Sequence[int]  # the chunk's tokens, positions start .. start + len - 1
    start: int
    table: Sequence[int]  # its sequence's KV block ids
    lookahead: int  # tokens to propose after it (0: the draft only reads it)
    prompt_length: int  # its sequence's prompt: positions from here on are generated tokens
    sampling: RowSampling
