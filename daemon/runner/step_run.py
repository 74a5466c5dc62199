"""What a runner hands back for a step (StepRun), what it holds while a step runs (PendingStep), and
the error that says its KV cache is gone (KVStateLost) — the same for every runner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from ember.daemon.step.row_sampling import RowSampling
from ember.kernels.sampling import Choice


@dataclass(frozen=True)
class StepRun:
    choices: list[Choice | None]  # one per sampling row, in order (None where sampling failed)
    # row index -> logits, for the rows asked to be kept: on the host, or on the device for a sequence
    # that keeps them there (RowSampling.device_logits)
    kept: dict[int, Any]
    failed: dict[int, str] = field(default_factory=dict)  # sampler index -> why its sampling failed
    # the hidden states entering each layer of ModelRunner.capture, every row of the step (device arrays)
    features: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class PendingStep:
    work: Any  # the logits (ModelRunner), or what a pipelined runner collects them by
    n_logits: int
    samplers: list[tuple[int, RowSampling]]
    keep: list[int]
    features: list[Any] = field(default_factory=list)  # ModelRunner.capture's hidden states


class KVStateLost(RuntimeError):
    """The runner lost KV cache contents (a layer-split stage process died and was restarted empty):
    every sequence with keys and values in this runner must end, and no cached prefix may be reused."""
