"""DraftProposer: the draft model beside the target — it reads every chunk the target reads, into a KV
cache of its own addressed by the same block tables, and proposes the next tokens of each sequence
the scheduler gave lookahead.

It stops drafting a sequence early where the draft is unsure (Leviathan et al. 2023, section 4
and the dynamic-length drafts after it): after a proposal where the draft's own distribution
(softmax of its logits) has a top probability below `min_prob`, no more proposals follow in that
step. A rejection is likely there, and every proposal costs a draft pass and a verification row
(docs/speculative.md has the data).
The rule reads only the draft's logits, never a token drawn from them nor the target, so the
output law stays the target's (tests/test_speculative_verification.py checks it; a rule that
read the drawn token would not be lossless, and the same test sees that).

Sharing the block tables means the block manager's allocations, prefix reuse and preemption hold for
both caches at once; the scheduler only ever counts as computed positions both models have run
(Scheduler._verified), so a reused block holds both models' K/V.
"""
from __future__ import annotations

import numpy as np

from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.step.step_work import WorkChunk
from ember.daemon.step.step_batch import ChunkSpec, StepBatch
from ember.daemon.speculative.verification import Proposal, draft_choice, draft_confidence

# the stopping rule's threshold, from the demo pair's acceptance by draft confidence (docs/speculative.md):
# the best, or within 0.01 of it, for greedy and temperature 0.7 requests at k = 4 to 8
DRAFT_MIN_PROB = 0.6


class DraftProposer:
    catches_up = True  # after steps without it, it reads the tokens it missed (WorkChunk.draft_prefix)

    def __init__(self, runner: ModelRunner, target_vocab: int, min_prob: float = DRAFT_MIN_PROB) -> None:
        """min_prob: stop drafting a sequence after a proposal where the draft's top probability is
        below it (0: always draft the whole lookahead)."""
        if runner.config.vocab != target_vocab:
            raise ValueError(f"the draft's vocabulary ({runner.config.vocab}) differs from the target's ({target_vocab})")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.runner = runner
        self.min_prob = min_prob

    def propose(self, chunks: list[WorkChunk]) -> dict[int, Proposal]:
        """Run `chunks` (a step's plan) through the draft; for each chunk with lookahead n, 1 to n
        proposed tokens, keyed by the chunk's index. The first pass runs every chunk and drafts one
        token for each speculating one; each further pass runs one token for each still drafting."""
        spec = [i for i, c in enumerate(chunks) if c.lookahead]
        proposals = {i: Proposal([], []) for i in spec}
        # a chunk whose draft fell behind reads the tokens it missed first (their K/V; the logits wanted
        # are still only its last token's)
        specs = [(list(c.draft_prefix) + list(c.tokens), c.start - len(c.draft_prefix), c.table) if c.draft_prefix
                 else (c.tokens, c.start, c.table) for c in chunks]
        active, wants = list(range(len(chunks))), [bool(c.lookahead) for c in chunks]
        for r in range(max((c.lookahead for c in chunks), default=0) or 1):  # once at least: the K/V
            logits = self._forward(specs, [chunks[i] for i in active], wants)
            drafting = [i for i, w in zip(active, wants) if w]
            unsure = set()
            for row, i in enumerate(drafting):
                p = proposals[i]
                token, probs = draft_choice(logits[row], chunks[i].sampling, p.tokens)
                p.tokens.append(token)
                if probs is not None:
                    p.probs.append(probs)
                if self.min_prob and chunks[i].lookahead > r + 1 and draft_confidence(logits[row]) < self.min_prob:
                    unsure.add(i)
            active = [i for i in drafting if chunks[i].lookahead > r + 1 and i not in unsure]
            if not active:
                break
            specs = [([proposals[i].tokens[-1]], chunks[i].start + len(chunks[i].tokens) + r, chunks[i].table)
                     for i in active]
            wants = [True] * len(active)
        return proposals

    def _forward(self, specs: list[ChunkSpec], chunks: list[WorkChunk], wants: list[bool]) -> np.ndarray:
        batch = StepBatch.build(specs, self.runner.block_size, wants_logits=wants,
                                prompt_lengths=[c.prompt_length for c in chunks])
        return self.runner.ops.to_numpy(self.runner.forward(batch))
