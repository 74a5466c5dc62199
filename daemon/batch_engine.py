"""BatchEngine: many sequences generated together — schedule a step, run it as one batch through the
model, sample each sequence's token, account the results. The daemon's engine thread drives `step()`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ember.daemon.block_manager import BlockManager
from ember.daemon.kv_cache import PagedKVCache
from ember.daemon.models.transformer import Transformer
from ember.daemon.scheduler import Scheduler, StepPlan
from ember.daemon.sequence import Sequence
from ember.daemon.step_batch import StepBatch
from ember.kernels.sampling import Choice, sample


@dataclass(frozen=True)
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    finished: bool


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_hit_rate: float
    preemptions: int


class BatchEngine:
    def __init__(self, net: Transformer, kv_blocks: int, block_size: int = 16, kv_dtype: str = "f32",
                 max_step_tokens: int = 256, max_running: int = 64, prefix_caching: bool = True) -> None:
        self.net = net
        self.cache: PagedKVCache = net.new_cache(kv_blocks, block_size, kv_dtype)
        self.blocks = BlockManager(kv_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_step_tokens, max_running, net.config.context_length)
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

    def step(self) -> list[StepOutput]:
        """One forward pass; returns the sequences that got new tokens or finished."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        choices = self._run(plan)
        finished = {s.seq_id for s in self.scheduler.update(plan, choices)}
        outputs = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.seq_id not in self._emitted:
                continue
            new = seq.generated[self._emitted[seq.seq_id]:]
            if new or seq.seq_id in finished:
                outputs.append(StepOutput(seq, new, seq.seq_id in finished))
                self._emitted[seq.seq_id] = len(seq.generated)
            if seq.seq_id in finished:
                del self._emitted[seq.seq_id]
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.n_blocks - self.blocks.num_free, kv_blocks_free=self.blocks.num_free,
            prefix_hit_rate=self.blocks.stats.hit_rate, preemptions=self.scheduler.preemptions,
        )

    def _run(self, plan: StepPlan) -> list[Choice]:
        batch = StepBatch.build(
            [(c.seq.tokens[c.start : c.start + c.length], c.start, c.seq.table) for c in plan.chunks],
            self.cache.block_size, wants_logits=[c.samples for c in plan.chunks],
        )
        if len(batch.logit_rows) == 0:
            self.net.forward(batch, self.cache)  # prompt chunks only: K/V written, no token yet
            return []
        logits = self.net.ops.to_numpy(self.net.forward(batch, self.cache))
        sampling = [c.seq for c in plan.chunks if c.samples]
        return [sample(row, s.params, s.rng, s.prompt, s.generated) for row, s in zip(logits, sampling)]
