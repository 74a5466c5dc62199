"""LocalExecutor: the engine's steps on one runner, one at a time — a step is submitted, then run
when collected. It carries out what a step's fields ask beyond one forward pass: a draft's proposals
(daemon/speculative/) read first and verified in the same pass, and a decode burst's further steps,
in one backend call where the runner has compiled greedy steps, else one after another."""
from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np

from ember.daemon.executor.burst import Burst
from ember.daemon.executor.logit_rows import LogitRows
from ember.daemon.executor.step_failed import StepFailed
from ember.daemon.runner.step_run import KVStateLost, StepRun
from ember.daemon.runner.step_runner import StepRunner
from ember.daemon.speculative.draft_proposer import DraftProposer
from ember.daemon.speculative.feature_proposer import FeatureProposer
from ember.daemon.speculative.ngram_proposer import NgramProposer
from ember.daemon.speculative.spec_stats import SpecStats
from ember.daemon.speculative.verification import Proposal, verify
from ember.daemon.step.step_work import StepOutcome, StepWork, WorkChunk
from ember.kernels.sampling import Choice


class LocalExecutor:
    depth = 1

    def __init__(self, runner: StepRunner, proposer: DraftProposer | FeatureProposer | NgramProposer | None = None,
                 spec_stats: SpecStats | None = None) -> None:
        """proposer: proposes tokens after each chunk with lookahead (then never a decode burst),
        counted in spec_stats."""
        self.runner, self.proposer = runner, proposer
        self.spec_stats = spec_stats if spec_stats is not None else SpecStats()
        self._queued: deque[StepWork] = deque()

    def submit(self, work: StepWork) -> None:
        self._queued.append(work)

    def collect(self) -> tuple[StepWork, StepOutcome]:
        work = self._queued.popleft()
        try:
            return work, self.run(work)
        except KVStateLost:
            raise
        except Exception as e:
            raise StepFailed(work, e) from e

    def cut(self, work: StepWork) -> None:
        """Nothing to cut: a step runs whole inside collect()."""

    def between_requests(self) -> None:
        self.runner.between_requests()

    def revive(self) -> bool:
        return self.runner.revive()

    def run(self, work: StepWork) -> StepOutcome:
        if work.lookup and work.steps and isinstance(self.proposer, NgramProposer):
            outcome = self._lookup_burst(work)
            if outcome is not None:
                return outcome
        proposing = self.proposer is not None and work.propose
        proposals = self.proposer.propose(work.chunks) if proposing else {}
        # the draft may stop short of the lookahead (an n-gram proposer may propose nothing for a
        # chunk): the step verifies what it proposed
        chunks = [replace(c, lookahead=len(proposals[i].tokens) if i in proposals else 0) if proposing and c.lookahead
                  else c for i, c in enumerate(work.chunks)]
        rows = LogitRows(chunks, proposing)
        if work.steps and not (work.steps == 1 and rows.keep):  # a single step too, unless logits go back
            choices, failed = self._burst(chunks, rows, work.steps)
            return StepOutcome(choices, failed=failed, steps=work.steps)  # type: ignore[arg-type]
        choices, run, failed = self._verified(chunks, rows, proposals)
        return StepOutcome(choices, rows.kept(run), failed, {i: len(p.tokens) for i, p in proposals.items()},
                           work.steps)

    def _burst(self, chunks: list[WorkChunk], rows: LogitRows, steps: int
               ) -> tuple[list[tuple[Choice, ...] | None], dict[int, str]]:
        """`steps` decode steps of the chunks' sequences (their slots reserved by the scheduler): a
        block of tokens each, ending at its stop id; the scheduler drops what follows max_tokens."""
        samplers = rows.samplers(chunks)
        burst = Burst(rows.batch(chunks, self.runner.block_size, {}), samplers, steps, self.runner.block_size)
        tokens = self.runner.greedy_steps(burst.batch, samplers, steps)
        if tokens is not None:  # every step in one backend call
            for row in tokens:
                burst.take([Choice(int(t), float("nan")) for t in row], {})
            return burst.result()
        while burst.took(self.runner.collect(self.runner.submit(burst.batch, samplers), burst.blocks)):
            pass
        return burst.result()

    def _lookup_burst(self, work: StepWork) -> StepOutcome | None:
        """A decode burst of one greedy sequence whose rounds verify n-gram proposals, in one compiled
        loop (ModelRunner.lookup_steps), up to work.steps tokens and work.lookup proposals a round; None
        where the runner has no such loop for it (the step is then a plain burst)."""
        assert isinstance(self.proposer, NgramProposer)
        rows = LogitRows(work.chunks, False)
        if len(work.chunks) != 1 or rows.keep:  # (logits going back: the per-step path returns them)
            return None
        chunk = work.chunks[0]
        lookup = self.proposer.burst_lookup(chunk.sampling, chunk.start + len(chunk.tokens), work.lookup, work.steps)
        got = self.runner.lookup_steps(rows.batch(work.chunks, self.runner.block_size, {}), rows.samplers(work.chunks),
                                       work.steps, lookup)
        if got is None:
            return None
        tokens, rounds, proposed, accepted = got
        self.spec_stats.proposed += proposed
        self.spec_stats.accepted += accepted
        self.spec_stats.steps += rounds
        return StepOutcome([tuple(Choice(int(t), float("nan")) for t in tokens)], steps=len(tokens))

    def _verified(self, chunks: list[WorkChunk], rows: LogitRows, proposals: dict[int, Proposal]
                  ) -> tuple[list[Choice | tuple[Choice, ...] | None], StepRun, dict[int, str]]:
        """One forward pass; per sampling chunk its token, or the block verification accepted of its
        proposals (then the target's own token)."""
        batch = rows.batch(chunks, self.runner.block_size, proposals)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        samplers = rows.samplers(chunks, proposals)
        run = self.runner.execute(batch, samplers, rows.keep + rows.verified)
        if isinstance(self.proposer, FeatureProposer):
            self.proposer.absorb(batch, run)  # every row's features, before any position counts as computed
        if not proposals:
            return list(run.choices), run, run.failed
        # one entry per sampling chunk again: the runner's samples, and the verified blocks in between
        sampled, plain = iter(run.choices), iter(range(len(samplers)))
        choices: list[Choice | tuple[Choice, ...] | None] = []
        failed: dict[int, str] = {}
        for k, i in enumerate(sampling):
            if i not in proposals:
                choices.append(next(sampled))
                if (j := next(plain)) in run.failed:
                    failed[k] = run.failed[j]
                continue
            first = rows.last[i] - len(proposals[i].tokens)
            try:
                block: tuple[Choice, ...] | None = verify(
                    np.stack([run.kept[r] for r in range(first, rows.last[i] + 1)]), proposals[i], chunks[i].sampling)
            except (ValueError, FloatingPointError, ArithmeticError) as e:
                block, failed[k] = None, f"sampling failed: {type(e).__name__}: {e}"
            else:
                self.spec_stats.add(len(proposals[i].tokens), len(block) - 1)
            choices.append(block)
        return choices, run, failed
