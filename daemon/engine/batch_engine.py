"""BatchEngine: many sequences generated together — schedule a step, run it as one batch through the
model, sample each sequence's token, account the results. The daemon's engine thread drives `step()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ember.daemon.engine.block_manager import BlockManager
from ember.daemon.runner.kv_cache import PagedKVCache
from ember.daemon.models.transformer import Transformer
from ember.daemon.engine.scheduler import Scheduler, StepPlan
from ember.daemon.engine.sequence import Sequence
from ember.daemon.runner.step_batch import StepBatch
from ember.kernels.sampling import Choice, sample


@dataclass(frozen=True)
class StepOutput:
    seq: Sequence
    new_tokens: list[int]  # at most one: a step samples one token per sequence
    finished: bool
    logits: np.ndarray | None = None  # [vocab] f32 the new token was sampled from, if seq.wants_logits


@dataclass(frozen=True)
class StepResult:
    tokens: int  # tokens run through the model (0: nothing was runnable)
    outputs: list[StepOutput] = field(default_factory=list)


@dataclass(frozen=True)
class BatchStats:
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_queries: int  # full prompt blocks looked up in the prefix cache
    prefix_hits: int  # of those, found
    preemptions: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BatchEngine:
    def __init__(self, net: Transformer, kv_blocks: int, block_size: int = 16, kv_dtype: str = "f32",
                 max_step_tokens: int = 256, max_running: int = 64, prefix_caching: bool = True,
                 max_context: int | None = None) -> None:
        """max_context: tokens per sequence at most (default and upper bound: the model's context)."""
        self.net = net
        self.cache: PagedKVCache = net.new_cache(kv_blocks, block_size, kv_dtype)
        self.blocks = BlockManager(kv_blocks, block_size, prefix_caching)
        context = min(max_context or net.config.context_length, net.config.context_length)
        self.scheduler = Scheduler(self.blocks, max_step_tokens, max_running, context)
        self._emitted: dict[int, int] = {}

    def add(self, seq: Sequence) -> None:
        seq.params.check_vocab(self.net.config.vocab)
        self.scheduler.add(seq)
        self._emitted[seq.seq_id] = 0

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        self.scheduler.abort(seq, reason)
        self._emitted.pop(seq.seq_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> StepResult:
        """One forward pass; its outputs are the sequences that got a new token or finished."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return StepResult(0)
        choices, logits = self._run(plan)
        finished = {s.seq_id for s in self.scheduler.update(plan, choices)}
        outputs = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.seq_id not in self._emitted:
                continue
            new = seq.generated[self._emitted[seq.seq_id]:]
            if new or seq.seq_id in finished:
                outputs.append(StepOutput(seq, new, seq.seq_id in finished, logits.get(seq.seq_id) if new else None))
                self._emitted[seq.seq_id] = len(seq.generated)
            if seq.seq_id in finished:
                del self._emitted[seq.seq_id]
        return StepResult(plan.n_tokens, outputs)

    def stats(self) -> BatchStats:
        return BatchStats(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.n_blocks - self.blocks.num_free, kv_blocks_free=self.blocks.num_free,
            prefix_queries=self.blocks.stats.prefix_queries, prefix_hits=self.blocks.stats.prefix_hits,
            preemptions=self.scheduler.preemptions,
        )

    def _run(self, plan: StepPlan) -> tuple[list[Choice], dict[int, np.ndarray]]:
        """The step's forward pass: a choice per sampling chunk, and the logits rows wanted kept."""
        batch = StepBatch.build(
            [(c.seq.tokens[c.start : c.start + c.length], c.start, c.seq.table) for c in plan.chunks],
            self.cache.block_size, wants_logits=[c.samples for c in plan.chunks],
        )
        if len(batch.logit_rows) == 0:
            self.net.forward(batch, self.cache)  # prompt chunks only: K/V written, no token yet
            return [], {}
        logits = self.net.ops.to_numpy(self.net.forward(batch, self.cache))
        sampling = [c.seq for c in plan.chunks if c.samples]
        choices = [sample(row, s.params, s.rng, s.prompt, s.generated) for row, s in zip(logits, sampling, strict=True)]
        return choices, {s.seq_id: row for row, s in zip(logits, sampling) if s.wants_logits}
