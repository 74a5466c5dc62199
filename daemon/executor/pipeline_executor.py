"""PipelineExecutor: the engine's steps through a layer split, one in flight per stage (the runner's
lanes), so that while one step runs on the last stage the next runs on the first.

A decode burst goes round: when its step comes back and more follow, its next step (the tokens just
sampled as input) is submitted at once and the flight queues behind the others — the lanes'
bursts interleave, and the engine sees the flight only when its burst is through. A flight the
engine cut (one of its sequences ended: its blocks may be someone else's now) takes no further step."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ember.daemon.executor.burst import Burst
from ember.daemon.executor.logit_rows import LogitRows
from ember.daemon.executor.step_failed import StepFailed
from ember.daemon.runner.step_run import KVStateLost, PendingStep, StepRun
from ember.daemon.runner.step_runner import StepRunner
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.step.step_work import StepOutcome, StepWork


@dataclass
class _Flight:
    work: StepWork
    rows: LogitRows
    pending: PendingStep  # its step in the stages now
    burst: Burst | None  # a decode burst's steps so far


class PipelineExecutor:
    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self._running: deque[_Flight] = deque()  # in the order the last stage returns them
        self._done: deque[tuple[StepWork, StepOutcome | Exception]] = deque()

    @property
    def depth(self) -> int:
        return self.runner.lanes

    def submit(self, work: StepWork) -> None:
        rows = LogitRows(work.chunks, proposing=False)
        batch = rows.batch(work.chunks, self.runner.block_size, {})
        samplers = rows.samplers(work.chunks)
        pending = self._submit(batch, samplers, rows.keep)
        burst = Burst(batch, samplers, work.steps, self.runner.block_size) if work.steps > 1 else None
        self._running.append(_Flight(work, rows, pending, burst))

    def collect(self) -> tuple[StepWork, StepOutcome]:
        while not self._done:
            self._advance()
        work, got = self._done.popleft()
        if isinstance(got, Exception):
            raise StepFailed(work, got)
        return work, got

    def run(self, work: StepWork) -> StepOutcome:
        """`work` alone: submitted, and the flights ahead of it advanced until it is through (theirs
        wait in order for collect())."""
        self.submit(work)
        while (done := next((d for d in self._done if d[0] is work), None)) is None:
            self._advance()
        self._done.remove(done)
        if isinstance(done[1], Exception):
            raise done[1]
        return done[1]

    def cut(self, work: StepWork) -> None:
        for flight in self._running:
            if flight.work is work and flight.burst is not None:
                flight.burst.cut = True

    def between_requests(self) -> None:
        self.runner.between_requests()

    def revive(self) -> bool:
        return self.runner.revive()

    def _advance(self) -> None:
        """Wait for the oldest flight's step: send a burst's next step round, or mark the flight done."""
        if not self._running:
            raise RuntimeError("the pipeline executor has nothing in flight to collect (a bug)")
        flight = self._running.popleft()
        burst = flight.burst
        try:
            run = self.runner.collect(flight.pending, burst.blocks if burst is not None else ())
            if burst is not None and burst.took(run):
                flight.pending = self._submit(burst.batch, burst.samplers)
                self._running.append(flight)
                return
            self._done.append((flight.work, self._outcome(flight, run)))
        except KVStateLost:
            self._drop_all()
            raise
        except Exception as e:
            self._done.append((flight.work, e))

    def _submit(self, batch: StepBatch, samplers: Sequence[tuple[int, RowSampling]], keep: Sequence[int] = ()) -> PendingStep:
        try:
            return self.runner.submit(batch, samplers, keep)
        except KVStateLost:  # found at a submit: the steps in flight were lost with the cache too
            self._drop_all()
            raise

    def _drop_all(self) -> None:
        """The stages lost every step they held (the engine ends their sequences): none is collected."""
        self._running.clear()
        self._done.clear()

    def _outcome(self, flight: _Flight, run: StepRun) -> StepOutcome:
        if flight.burst is None:
            return StepOutcome(list(run.choices), flight.rows.kept(run), run.failed, steps=flight.work.steps)
        choices, failed = flight.burst.result()
        return StepOutcome(choices, failed=failed, steps=flight.burst.taken)  # type: ignore[arg-type]
