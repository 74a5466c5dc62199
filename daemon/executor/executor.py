"""Executor: the interface the engine's step loop drives (EngineCore.step: schedule, submit, collect,
update), and the choice of executor for a runner.

`depth` steps may be submitted before the oldest is collected: one on a single device (submit only
queues; collect runs it), one per stage of a layer split (each submit starts a step in the first
stage). What a step does beyond one forward pass — a draft's proposals and their verification, a
decode burst's further steps — it carries out behind this interface, from the step's own fields."""
from __future__ import annotations

from typing import Protocol

from ember.daemon.executor.local_executor import LocalExecutor
from ember.daemon.executor.pipeline_executor import PipelineExecutor
from ember.daemon.runner.step_runner import StepRunner
from ember.daemon.speculative.draft_proposer import DraftProposer
from ember.daemon.speculative.feature_proposer import FeatureProposer
from ember.daemon.speculative.ngram_proposer import NgramProposer
from ember.daemon.speculative.spec_stats import SpecStats
from ember.daemon.step.step_work import StepOutcome, StepWork


class Executor(Protocol):
    runner: StepRunner

    @property
    def depth(self) -> int:
        """Steps in flight at most."""
        ...

    def submit(self, work: StepWork) -> None:
        """Take a step (it may start at once, or when collected); raises only where it was refused
        before anything ran."""
        ...

    def collect(self) -> tuple[StepWork, StepOutcome]:
        """A submitted step that is through, and what it gave: the oldest on one device; on a split
        the first whose work is done (a burst's flight goes round again). StepFailed names a step
        that failed; KVStateLost drops every step in flight."""
        ...

    def run(self, work: StepWork) -> StepOutcome:
        """One step alone, now (the engine runs a failed step's chunks so, one by one)."""
        ...

    def cut(self, work: StepWork) -> None:
        """A sequence of this submitted step ended: a burst of it takes no further step."""
        ...

    def between_requests(self) -> None:
        ...

    def revive(self) -> bool:
        """The runner's revive (runner/step_runner.py): idle, before new work."""
        ...


def executor_for(runner: StepRunner, proposer: DraftProposer | FeatureProposer | NgramProposer | None = None,
                 spec_stats: SpecStats | None = None) -> Executor:
    """A pipeline executor for a runner that keeps several steps in flight (a layer split's lanes)
    and has no draft beside it; a local one otherwise (with a draft, one step at a time: the draft
    reads each step's tokens before the target runs them)."""
    if proposer is None and runner.lanes > 1:
        return PipelineExecutor(runner)
    return LocalExecutor(runner, proposer, spec_stats)
