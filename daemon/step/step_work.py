"""StepWork: one step as the engine hands it to its executor — plain data, no Sequence: each chunk's
tokens and where their keys and values go, how its sequence samples, which logits rows it wants back,
and how many tokens may follow it in the same step (a draft's proposals, or a decode burst's steps).
StepOutcome is what the executor hands back."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ember.daemon.step.row_sampling import RowSampling
from ember.kernels.sampling import Choice


@dataclass(frozen=True)
class WorkChunk:
    tokens: Sequence[int]  # the chunk's tokens, positions start .. start + len - 1
    start: int
    table: Sequence[int]  # its sequence's KV block ids
    lookahead: int  # KV slots after it: for proposed tokens (with a proposer), else a decode burst's
    prompt_length: int  # its sequence's prompt: positions from here on are generated tokens
    sampling: RowSampling
    samples: bool = True  # a token is sampled after its last one
    state_slot: int = 0  # its recurrent state's slot (hybrid models)
    all_logits: bool = False  # every position's logits go back (a prompt-logits request)
    wants_logits: bool = False  # the logits its token is sampled from go back
    # the tokens before `start` a draft model has not read (it fell behind while steps ran without it,
    # engine_core.py): a proposer reads them first
    draft_prefix: Sequence[int] = ()


@dataclass(frozen=True)
class StepWork:
    chunks: list[WorkChunk]
    # decode steps to run in a row (a decode burst: every chunk one token that samples, no proposer),
    # each one's sampled tokens the next one's input; 0: the step is not a plain decode step
    steps: int = 0
    propose: bool = True  # a proposer, where the executor has one, proposes after the chunks with lookahead
    # a decode burst (steps > 0) whose rounds verify up to this many n-gram proposals (the executor's
    # NgramProposer), in one compiled loop where the runner has one, else a plain burst; 0: not one
    lookup: int = 0


@dataclass(frozen=True)
class StepOutcome:
    # per sampling chunk, in order: its token, the block a burst or a verification gave it, or None
    # where its sampling failed (why in `failed`)
    choices: list[Choice | tuple[Choice, ...] | None]
    logits: dict[int, np.ndarray] = field(default_factory=dict)  # chunk index -> [rows, vocab] going back
    failed: dict[int, str] = field(default_factory=dict)  # sampling chunk index -> why its sampling failed
    proposed: dict[int, int] = field(default_factory=dict)  # chunk index -> tokens a proposer proposed
    steps: int = 0  # decode steps it ran
