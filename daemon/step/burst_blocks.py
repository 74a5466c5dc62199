"""BurstBlocks: the tokens each sequence of a decode burst (engine/decode_burst.py) got so far, for the
runner that runs the burst in one call (ModelRunner.decode) and for the engine that runs it through a
pipelined layer split one step at a time."""
from __future__ import annotations

from collections.abc import Sequence as Seq

from ember.daemon.step.row_sampling import RowSampling
from ember.kernels.sampling import Choice


class BurstBlocks:
    """The tokens each sequence of a decode burst got so far: a block each, which ends at its stop id,
    where its sampling failed, or with the burst."""

    def __init__(self, samplers: Seq[tuple[int, RowSampling]]) -> None:
        self.samplers = samplers  # (logits row, its sampling) of each sampling sequence, in the step's order
        self.blocks: list[list[Choice]] = [[] for _ in samplers]
        self.failed: dict[int, str] = {}  # sampler index -> why its sampling failed
        self.done = [False] * len(samplers)
        self.steps = 0  # steps taken

    def take(self, choices: Seq[Choice | None], failed: dict[int, str]) -> None:
        """One step's choices, one per sampler (None where its sampling failed, why in `failed`); a
        sequence whose block has ended takes no more."""
        self.steps += 1
        for k, choice in enumerate(choices):
            if self.done[k]:
                continue
            if choice is None:
                self.failed[k], self.done[k] = failed[k], True
                continue
            self.blocks[k].append(choice)
            self.done[k] = choice.token in self.samplers[k][1].stop_ids

    @property
    def finished(self) -> bool:
        return all(self.done)

    def last_ids(self) -> list[int]:
        """Each sequence's newest token: the next step's input."""
        return [block[-1].token if block else s.last_token for block, (_, s) in zip(self.blocks, self.samplers,
                                                                                    strict=True)]

    def result(self) -> tuple[list[tuple[Choice, ...] | None], dict[int, str]]:
        """Per sampler its block (None where its sampling failed), and the failures."""
        return [None if k in self.failed else tuple(block) for k, block in enumerate(self.blocks)], self.failed
