"""Burst: a decode burst run one step at a time — several decode steps of the same sequences in a row
(engine/decode_burst.py sizes them), each step's sampled tokens the next one's input, in KV slots the
scheduler reserved. The one loop both executors run a burst by: LocalExecutor back to back,
PipelineExecutor interleaved with the other lanes' steps. (A runner with compiled greedy steps
runs a whole greedy burst in one call instead: ModelRunner.greedy_steps.)"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from ember.daemon.runner.step_run import StepRun
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.sampling import Choice


class Burst:
    def __init__(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int, block_size: int) -> None:
        """batch: the burst's first step (host arrays); samplers: (logits row, its sampling) of each
        sequence, in the step's order; steps: decode steps to run at most."""
        self.batch, self.samplers, self.steps, self.block_size = batch, samplers, steps, block_size
        self.blocks: list[list[Choice]] = [[] for _ in samplers]  # each sequence's tokens so far
        self.failed: dict[int, str] = {}  # sampler index -> why its sampling failed
        self.done = [False] * len(samplers)
        self.taken = 0  # steps taken
        self.cut = False  # a sequence of it ended meanwhile: its blocks may be someone else's now

    def took(self, run: StepRun) -> bool:
        """Take one step's choices (a sequence whose block has ended takes no more); whether another
        step follows, its batch then ready in `batch`."""
        self.take(run.choices, run.failed)
        if self.taken >= self.steps or all(self.done) or self.cut:
            return False
        self.batch = self.batch.following(np.array(self.last_ids(), np.int64), self.block_size)
        return True

    def take(self, choices: Seq[Choice | None], failed: dict[int, str]) -> None:
        """One step's choices, one per sampler (None where its sampling failed, why in `failed`)."""
        self.taken += 1
        for k, choice in enumerate(choices):
            if self.done[k]:
                continue
            if choice is None:
                self.failed[k], self.done[k] = failed[k], True
                continue
            self.blocks[k].append(choice)
            self.done[k] = choice.token in self.samplers[k][1].stop_ids

    def last_ids(self) -> list[int]:
        """Each sequence's newest token: the next step's input."""
        return [block[-1].token if block else s.last_token for block, (_, s) in zip(self.blocks, self.samplers,
                                                                                    strict=True)]

    def result(self) -> tuple[list[tuple[Choice, ...] | None], dict[int, str]]:
        """Per sampler its block (None where its sampling failed), and the failures."""
        return [None if k in self.failed else tuple(block) for k, block in enumerate(self.blocks)], self.failed
