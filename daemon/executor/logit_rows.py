"""LogitRows: which logits row of a step belongs to which chunk, and the step's host batch.

A prompt-logits chunk has a row per token, a sampling chunk one (its last token) and one per proposed
token after it, others none. The rows that go back to the host are those asked for, and those a
draft's proposals are verified against."""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from ember.daemon.runner.step_run import StepRun
from ember.daemon.speculative.verification import Proposal
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.step.step_work import WorkChunk


class LogitRows:
    def __init__(self, chunks: Seq[WorkChunk], proposing: bool) -> None:
        """proposing: the chunks' lookahead is for proposed tokens, each a logits row (else for a
        decode burst, whose later steps are batches of their own)."""
        self.first: list[int] = []
        self.last: list[int] = []
        self.count: list[int] = []
        self.keep: list[int] = []
        self.verified: list[int] = []
        self.returned: list[bool] = []  # per chunk: its rows go back in StepOutcome.logits
        n = 0
        for c in chunks:
            count = len(c.tokens) if c.all_logits else int(c.samples) * (1 + (c.lookahead if proposing else 0))
            returned = c.all_logits or (c.samples and c.wants_logits)
            self.first.append(n)
            self.last.append(n + count - 1)
            self.count.append(count)
            if returned:
                self.keep.extend(range(n, n + count))
            elif c.lookahead:
                self.verified.extend(range(n, n + count))
            self.returned.append(returned)
            n += count

    def samplers(self, chunks: Seq[WorkChunk], skip: Seq[int] | dict[int, Proposal] = ()) -> list[tuple[int, RowSampling]]:
        """(logits row, sampling) of each sampling chunk not in `skip`, in order."""
        return [(self.last[i], c.sampling) for i, c in enumerate(chunks) if c.samples and i not in skip]

    def kept(self, run: StepRun) -> dict[int, np.ndarray]:
        """Per chunk whose rows go back: its [rows, vocab] logits."""
        logits = {}
        for i, returned in enumerate(self.returned):
            rows = range(self.first[i], self.last[i] + 1)
            if returned and rows and rows[0] in run.kept:
                # one row (a sampled token's; on the device where its sequence keeps them there) or a prompt's
                logits[i] = run.kept[rows[0]].reshape(1, -1) if len(rows) == 1 else np.stack([run.kept[r] for r in rows])
        return logits

    def batch(self, chunks: Seq[WorkChunk], block_size: int, proposals: dict[int, Proposal]) -> StepBatch:
        """The step's host batch: each chunk's tokens, then its proposed ones (verified in the same pass)."""
        return StepBatch.build(
            [(list(c.tokens) + proposals[i].tokens if i in proposals else c.tokens, c.start, c.table)
             for i, c in enumerate(chunks)],
            block_size, all_logits=[c.all_logits for c in chunks], wants_logits=[c.samples for c in chunks],
            prompt_lengths=[c.prompt_length for c in chunks], state_slots=[c.state_slot for c in chunks],
            logit_tails=self.count if proposals else None)
