"""StepFailed: a submitted step failed as a whole (its forward pass, or its sampling as a batch);
`work` names it, so the engine can find whose it was."""
from __future__ import annotations

from ember.daemon.step.step_work import StepWork


class StepFailed(Exception):
    def __init__(self, work: StepWork, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.work, self.error = work, error
