"""SpecStats: how speculation went — tokens proposed, accepted, and verification passes; with an
adaptive draft (spec_switch.py), the tokens decoded without it and what each mode costs a token."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    proposed: int = 0  # draft tokens offered for verification
    accepted: int = 0  # of those, kept
    steps: int = 0  # verification passes (one per sequence per engine step that speculated)
    plain_tokens: int = 0  # tokens decoded without speculating while a draft was loaded (SpecSwitch's choice)
    # seconds per generated token as the SpecSwitch last measured them, speculating and not (0: not yet)
    spec_s_per_token: float = 0.0
    plain_s_per_token: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_proposals(self) -> float:
        """The k chosen, on average: draft tokens a verification pass checked (the draft stops early
        where it is unsure, daemon/speculative/draft_proposer.py; 0: none ran)."""
        return self.proposed / self.steps if self.steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification pass yields: the accepted proposals plus the target's own token."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def saved_s_per_token(self) -> float:
        """What speculating saves a token against decoding plainly (negative: what it costs), as measured."""
        if not (self.spec_s_per_token and self.plain_s_per_token):
            return 0.0
        return self.plain_s_per_token - self.spec_s_per_token

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
