"""FeatureProposer: a feature-conditioned (DFlash) draft beside the target — the counterpart of
DraftProposer for drafts that read the target's hidden states instead of running every token.

Each step, for every sequence the scheduler gave lookahead k (its chunk is then the one token sampled
last, at position n), one pass of the draft over the noise block [that token, mask x k] at positions
n .. n + k proposes all k tokens; verification (verification.py) is the same as for a draft model.
After the target's pass, every row it ran hands back its hidden states at the draft's target layers
(ModelRunner.capture): they go into the FeatureMirror at the row's KV slot, in the mirror's dtype,
and are read back as f32 and injected into the draft's KV cache (DFlashDraft.inject) — in the same
step, so every position the scheduler counts as computed has the target's K/V, its mirrored
features and the draft's injected K/V, and a block reused from the prefix cache holds all three.
Rejected proposals' rows land past the sequence's computed positions and are overwritten before
anything reads them, exactly as in the KV cache.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ember.daemon.models.dflash import DFlashDraft
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.runner.step_run import StepRun
from ember.daemon.step.step_work import WorkChunk
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.speculative.draft_proposer import DRAFT_MIN_PROB
from ember.daemon.speculative.feature_mirror import FeatureMirror
from ember.daemon.speculative.verification import Proposal, draft_choice, draft_confidence
from ember.kernels.convert import DEFAULT_KV_DTYPE


class FeatureProposer:
    def __init__(self, draft: DFlashDraft, target: ModelRunner, kv_dtype: str = DEFAULT_KV_DTYPE, feature_dtype: str = "f32",
                 min_prob: float = DRAFT_MIN_PROB) -> None:
        """The draft's KV cache and the feature mirror get the target runner's blocks and block size;
        the target runner is set to capture the draft's target layers. min_prob: a block's proposals
        end after the first whose distribution's top probability is below it (llama.cpp's p_min; 0:
        the whole block), as a draft model's do (DraftProposer); it reads only the draft's
        distribution, so it is lossless. On the trained demo draft it keeps the mean accepted length
        (1.56 -> 1.54 greedy) and cuts the target's rows per token from 4.9 to 1.4 (docs/speculative.md)."""
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.draft, self.target, self.min_prob = draft, target, min_prob
        self.kv_blocks, self.block_size = target.kv_blocks, target.block_size
        self.cache = draft.new_cache(self.kv_blocks, self.block_size, kv_dtype)
        self.mirror = FeatureMirror(self.kv_blocks, self.block_size, draft.width, feature_dtype)
        target.capture = draft.target_layers

    @property
    def max_proposals(self) -> int:
        """Tokens one block proposes at most: the trained block less its first (known) token."""
        return self.draft.spec.max_proposals

    def propose(self, chunks: list[WorkChunk]) -> dict[int, Proposal]:
        """For each chunk with lookahead k (one token: the last sampled), k proposed tokens, keyed by
        the chunk's index: one draft pass over all their noise blocks."""
        spec = [i for i, c in enumerate(chunks) if c.lookahead]
        if not spec:
            return {}
        mask = self.draft.spec.mask_id
        blocks = [chunks[i] for i in spec]
        batch = StepBatch.build([([c.tokens[0]] + [mask] * c.lookahead, c.start, c.table) for c in blocks],
                                self.block_size, prompt_lengths=[c.prompt_length for c in blocks],
                                logit_tails=[c.lookahead for c in blocks])
        ends = np.repeat([c.start + c.lookahead for c in blocks], [1 + c.lookahead for c in blocks])
        batch = replace(batch, attn_end=ends)  # the block is not causal: each token sees all of it
        logits = self.draft.ops.to_numpy(self.draft.block_logits(self.target.prepare(batch), self.cache))
        proposals, first = {}, 0
        for i, c in zip(spec, blocks, strict=True):
            p = proposals[i] = Proposal([], [])
            for row in range(first, first + c.lookahead):
                token, probs = draft_choice(logits[row], c.sampling, p.tokens)
                p.tokens.append(token)
                if probs is not None:
                    p.probs.append(probs)
                if self.min_prob and draft_confidence(logits[row]) < self.min_prob:
                    break  # the step verifies the shorter proposal (LocalExecutor.run)
            first += c.lookahead
        return proposals

    def absorb(self, batch: StepBatch, run: StepRun) -> None:
        """The target ran `batch` (host arrays): mirror its rows' features and inject them."""
        ops = self.draft.ops
        features = np.concatenate([ops.to_numpy(f) for f in run.features], axis=1)
        self.mirror.write(batch.kv_blocks, batch.kv_offsets, features)
        rows = self.mirror.read(batch.kv_blocks, batch.kv_offsets)  # what the draft reads: the stored dtype, as f32
        self.draft.inject(ops.to_device(rows), self.target.prepare(batch), self.cache)
