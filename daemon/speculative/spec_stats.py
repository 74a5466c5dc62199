"""SpecStats: how speculation went — tokens proposed, accepted, and verification passes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    proposed: int = 0  # draft tokens offered for verification
    accepted: int = 0  # of those, kept
    steps: int = 0  # verification passes (one per sequence per engine step that speculated)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification pass yields: the accepted proposals plus the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
