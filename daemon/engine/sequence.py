"""Sequence: the engine's mutable state of one generation request (never sent over a socket)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ember.daemon.engine.block_manager import prefix_root
from ember.daemon.step.row_sampling import RowSampling, TokenConstraint
from ember.kernels.sampling import Choice, SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    client: object = None  # whose request it is, for fairness between clients
    seq_id: int = field(default_factory=lambda: next(_ids))
    generated: list[int] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    table: list[int] = field(default_factory=list)  # KV block ids
    n_computed: int = 0  # tokens whose K/V are in the cache
    # where a draft model's K/V ends when it fell behind (steps ran without it: SpecSwitch chose plain
    # decoding); None: it has read every token the target has
    draft_pos: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    preemptions: int = 0
    wants_logits: bool = False  # keep the logits each token was sampled from (StepOutput.logits)
    wants_logprob: bool = False  # compute each chosen token's logprob (else Choice.logprob is NaN)
    prompt_logits: bool = False  # keep the logits of every position computed (StepOutput.logits)
    in_flight: bool = False  # in a step a pipelined runner has not returned yet: not scheduled, never preempted
    logits_returned: int = 0  # with prompt_logits: positions whose logits went out (a recompute repeats none)
    state_slot: int = -1  # while running: its recurrent state's slot (hybrid models)
    held: bool = False  # set by the daemon while the client cannot take output: not scheduled, keeps its blocks
    started: float | None = None  # perf_counter() when first admitted to run
    grammar: str | None = None  # llguidance's grammar its tokens must follow (daemon/text/grammar.py)
    cache_salt: bytes = b""  # its prefix-cache blocks are shared only with sequences of the same salt
    device_logits: bool = False  # with wants_logits: StepOutput.logits stays on the model's device (its array type)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        # what a runner samples its rows by: the same generator and token lists as this sequence's
        self.sampling = RowSampling(self.params, self.rng, self.prompt, self.generated, self.stop_ids, self.wants_logprob,
                                    device_logits=self.device_logits)
        self.tokens: list[int] = list(self.prompt) + self.generated  # prompt + generated, kept, not rebuilt per step
        self.registered: tuple[int, bytes] | None = None  # prefix-cache progress: (full blocks, last digest)
        self.prefix_root = prefix_root(self.cache_salt)  # where its blocks' digest chain starts

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def can_speculate(self) -> bool:
        """Whether proposed tokens may be verified for it: not when it asks for the logits of
        every token it gets, which come one step at a time."""
        return not (self.wants_logits or self.prompt_logits)

    @property
    def pending(self) -> int:
        """Tokens to run through the model before the next one can be sampled."""
        return self.n_tokens - self.n_computed

    @property
    def constraint(self) -> TokenConstraint | None:
        """Its grammar, compiled by the engine that took it (None before, or without one)."""
        return self.sampling.constraint

    def append(self, choice: Choice) -> None:
        if self.sampling.constraint is not None:
            self.sampling.constraint.accept(choice.token)
        self.generated.append(choice.token)
        self.tokens.append(choice.token)
        self.choices.append(choice)
