"""RowSampler: sampling where a step's logits are — one component every runner uses, so that a
token is drawn by the same code whether the model ran on this device or in a layer split's stages.
Only token ids leave the device, and the logits rows a step asks to keep.

It is where a step's sequences' sampling (RowSampling: a generator, a token history, a grammar, host
state that a decode burst's own tokens change between its steps) becomes arrays, a SamplingBatch, at
the moment the step samples; the backend's sampler sees only those."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from ember.daemon.runner.step_run import PendingStep, StepRun
from ember.daemon.step.row_sampling import RowSampling
from ember.kernels.ops import Array
from ember.kernels.sampling import Choice, SampleRow
from ember.kernels.sampling_batch import SamplingBatch


class RowSampler:
    def __init__(self, ops: Any) -> None:
        self.ops = ops  # the backend the logits live on

    def finish(self, logits: Array, step: PendingStep, pending: Seq[Seq[Choice]] = ()) -> StepRun:
        """A step's sampled tokens and kept logits rows, from its logits; pending: as sample()'s."""
        if step.n_logits == 0:
            return StepRun([], {}, features=step.features)
        choices, failed = self.sample(logits, step.samplers, pending)
        kept = {}
        if step.keep:  # (not on a step's hot path when no row asks for its logits)
            on_device = {r for r, s in step.samplers if s.device_logits}
            kept = {r: logits[r].copy() if r in on_device else self.ops.to_numpy(logits[r]) for r in step.keep}
        return StepRun(choices, kept, failed, step.features)

    def sample(self, logits: Array, samplers: Seq[tuple[int, RowSampling]], pending: Seq[Seq[Choice]] = ()
               ) -> tuple[list[Choice | None], dict[int, str]]:
        """Row r for each (r, sequence) of `samplers`, with that sequence's parameters and generator.
        pending: per sampler, tokens sampled for its sequence that it has not appended yet (a decode
        burst's), which penalties count as generated and a grammar as accepted."""
        if not samplers:
            return [], {}
        if plain_greedy(samplers):  # the greedy fast path: one argmax over the rows, no per-row copy
            rows = np.fromiter((r for r, _ in samplers), np.int64, len(samplers))
            best = self.ops.to_numpy(self.ops.argmax_rows(logits, rows))
            return [Choice(int(t), float("nan")) for t in best], {}
        rows: list[SampleRow] = []
        at: list[int] = []  # the sampler index of each row
        failed: dict[int, str] = {}
        choices: list[Choice | None] = [None] * len(samplers)
        extras = [[c.token for c in pending[k]] if pending and pending[k] else [] for k in range(len(samplers))]
        argmax = self._grammar_argmax(logits, samplers, extras)
        for k, (r, s) in enumerate(samplers):
            extra = extras[k]
            if k in argmax:
                choices[k] = argmax[k]
                continue
            try:
                allowed = s.allowed(extra)
            except ValueError as e:  # the grammar is in error: this sequence's failure alone
                failed[k] = f"constrained decoding failed: {e}"
                continue
            rows.append(SampleRow(r, s.params, s.rng, s.prompt, s.generated + extra if extra else s.generated,
                                  s.wants_logprob, allowed))
            at.append(k)
        for k, c in zip(at, self.ops.sample_rows(logits, SamplingBatch.of(rows)) if rows else [], strict=True):
            if isinstance(c, str):
                failed[k] = c
            else:
                choices[k] = c
        return choices, failed

    def _grammar_argmax(self, logits: Array, samplers: Seq[tuple[int, RowSampling]], extras: Seq[list[int]]
                        ) -> dict[int, Choice]:
        """The greedy rows under a grammar (nothing else asked) whose argmax the grammar allows: that
        token is the masked argmax too, found without computing the mask (the model mostly writes
        what its grammar allows). extras: per sampler, its pending tokens. By sampler index; the others
        take the masked path."""
        greedy = [k for k, (_, s) in enumerate(samplers)
                  if s.constraint is not None and s.params.plain_greedy and not s.wants_logprob]
        if not greedy:
            return {}
        rows = np.fromiter((samplers[k][0] for k in greedy), np.int64, len(greedy))
        best = self.ops.to_numpy(self.ops.argmax_rows(logits, rows))
        out = {}
        for k, token in zip(greedy, best.tolist(), strict=True):
            s = samplers[k][1]
            assert s.constraint is not None
            if s.constraint.allows(token, extras[k]):
                out[k] = Choice(int(token), float("nan"))
        return out


def plain_greedy(samplers: Seq[tuple[int, RowSampling]]) -> bool:
    """Every sequence takes its logits' argmax and asks for nothing else (no penalties, no logprobs, no
    grammar)."""
    return all(s.plain_greedy for _, s in samplers)
