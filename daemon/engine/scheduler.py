"""Scheduler: continuous batching over a paged KV cache.

Each step, `schedule()` gives every running sequence its next tokens (decodes first, one token each,
then chunks of prompts being read) within a token budget, and admits waiting sequences while the
budget and free KV blocks allow — reusing cached prefix blocks. When blocks run out it preempts the
youngest running sequence (its blocks are freed and it is recomputed later; nothing is lost).
`update()` takes the sampled tokens and finishes sequences: this is where every sequence's end is
decided (a stop id, max_tokens, the context; cancelling and stop strings end it through `abort`). A sequence marked `held` (its client
cannot take more output now) is skipped: it keeps its blocks and its place, and runs again once
released. With speculative decoding (`lookahead` > 0) a sampling chunk also gets KV slots for up to
`lookahead` proposed tokens, which the engine verifies in the same pass; `update()` then takes a
block of tokens for it and rolls the cache back past the first rejected one. Without a draft, a step
in which every runnable sequence decodes and nobody waits may give each decode `decode_lookahead`
such slots: the engine then runs that many decode steps more in one go (a decode burst) and
`update()` takes the block they sampled. Pure Python: testable without a model.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ember.daemon.engine.block_manager import BlockManager
from ember.daemon.engine.sequence import Sequence, Status
from ember.kernels.sampling import Choice


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position run in this step
    length: int
    lookahead: int = 0  # KV slots reserved after the chunk for proposed tokens (speculative decoding; decode bursts)

    @property
    def reaches_end(self) -> bool:
        """Whether this chunk runs the sequence's last token: after it, a token can be sampled."""
        return self.start + self.length == self.seq.n_tokens

    @property
    def samples(self) -> bool:
        """Whether a token is sampled from this chunk (the end is reached and max_tokens not yet)."""
        return self.reaches_end and len(self.seq.generated) < self.seq.max_tokens


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk]
    started: list[Sequence] = field(default_factory=list)  # sequences running for the first time

    @property
    def n_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_step_tokens: int = 256, max_running: int = 64,
                 max_context: int | None = None, lookahead: int = 0, align: int = 1,
                 no_draft_cache: bool = False) -> None:
        """align: a prompt run that stops short of the sequence's end stops at a multiple of `align`
        positions (a hybrid model's delta-rule chunk: its rounding then does not depend on how steps
        cut the prompt). no_draft_cache: the proposals come without a draft model's KV cache (a draft
        that reads the target's features, DFlash; or n-gram lookup): only a one-token chunk can
        speculate (its context must be computed), and every accepted proposal counts as computed (the
        target ran it; a feature draft took its features, n-grams need nothing)."""
        self.blocks = blocks
        self.no_draft_cache = no_draft_cache
        self.align = align
        self.lookahead = lookahead
        # without a draft: slots for the tokens a decode burst samples after the first (EngineCore
        # sets it before each schedule; 0: one token a step)
        self.decode_lookahead = 0
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        pool_tokens = blocks.n_blocks * blocks.block_size
        self.max_context = min(max_context or pool_tokens, pool_tokens)
        self._free_slots = list(range(max_running - 1, -1, -1))  # a running sequence holds one: Sequence.state_slot
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    # --- requests in and out ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if len(seq.prompt) + (seq.max_tokens > 0) > self.max_context:  # room for the prompt and one token
            raise ValueError(f"prompt of {len(seq.prompt)} tokens does not fit the context of {self.max_context}")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        if seq.status == Status.FINISHED:
            return  # cancelling twice, or after the end, is harmless
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._finish(seq, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> StepPlan:
        """The next step: at most max_steps_tokens tokens of at most `max_seqs` sequences, none of
        them in flight (a pipelined runner's earlier step)."""
        budget = self.max_step_tokens
        room = max_seqs or self.max_running
        chunks: list[ScheduledChunk] = []
        started: list[Sequence] = []
        burst = self._bursting()
        # decodes (one pending token) before prompt chunks, oldest first: latency of running streams
        for seq in sorted(self.running, key=lambda s: (s.pending > 1, s.seq_id)):
            if budget == 0 or len(chunks) == room or seq not in self.running or seq.held or seq.in_flight:
                continue  # out of budget or room, preempted by an older sequence in this loop, held or in flight
            length = self._cut(seq, min(seq.pending, budget))
            if length == 0:
                continue  # too little budget left for an aligned piece of its prompt
            extra = self._lookahead(seq, length, budget - length, burst)
            if not self._grow(seq, seq.n_computed + length + extra):
                continue
            chunks.append(ScheduledChunk(seq, seq.n_computed, length, extra))
            budget -= length + extra
        chunks = [c for c in chunks if c.seq.status == Status.RUNNING]  # drop those preempted meanwhile
        self._swap_out_held()
        while budget and len(chunks) < room and len(self.running) < self.max_running \
                and any(not s.held for s in self.waiting):
            seq = self._next_waiting()
            first = seq.started is None
            length = self._admit(seq, budget)
            if length == 0:
                break  # no memory for it now: it keeps its place at the head of the queue
            chunks.append(ScheduledChunk(seq, seq.n_computed, length))
            budget -= length
            if first:
                started.append(seq)
        return StepPlan(chunks, started)

    def update(self, plan: StepPlan, choices: Iterable[Choice | tuple[Choice, ...]]) -> list[Sequence]:
        """Account the step's work; `choices` has one entry per sampling chunk, in plan order: a
        Choice, or for a chunk with lookahead the verified block (accepted proposals, then the
        target's own token). Returns the sequences that finished."""
        sampled = iter(choices)
        finished = []
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status != Status.RUNNING:
                continue  # aborted while the step ran
            seq.n_computed = chunk.start + chunk.length
            reason = None
            if chunk.samples:
                picked = next(sampled)
                block = picked if isinstance(picked, tuple) else (picked,)
                for choice in block:  # tokens after a stop are dropped, as if never proposed
                    seq.append(choice)
                    reason = self._finish_reason(seq, choice.token)
                    if reason:
                        break
                if chunk.lookahead:
                    seq.n_computed += self._verified(chunk, len(block) - 1)
            elif chunk.reaches_end:
                reason = "length"  # max_tokens 0: the prompt was all that was asked for
            seq.registered = self.blocks.register(seq.table, seq.tokens, seq.n_computed, seq.registered,
                                                  seq.prefix_root)
            if reason:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
            elif chunk.lookahead:
                self._roll_back(seq)
        return finished

    # --- speculative decoding and decode bursts --------------------------------------------------
    def _bursting(self) -> bool:
        """Whether this step's decodes may take slots for a burst: only when every runnable sequence
        decodes (a burst's steps are all decodes) and nobody waits (a burst delays an admission)."""
        if not self.decode_lookahead or any(not s.held for s in self.waiting):
            return False
        return all(s.pending == 1 for s in self.running if not s.held and not s.in_flight)

    def _lookahead(self, seq: Sequence, length: int, budget: int, burst: bool) -> int:
        """Slots for proposed tokens (or a decode burst's) after this chunk: none unless it samples;
        never more than the tokens the sequence may still add after the one it samples (max_tokens,
        context) nor than free memory allows without preempting anyone."""
        if not seq.can_speculate or seq.n_computed + length != seq.n_tokens:
            return 0
        if self.lookahead:
            if self.no_draft_cache and length != 1:
                return 0
            wanted = self.lookahead
        elif burst and length == 1:
            wanted = self.decode_lookahead
        else:
            return 0
        n = min(wanted, budget, seq.max_tokens - len(seq.generated) - 1,
                self.max_context - seq.n_tokens - 1)
        if n > 0 and not self.blocks.can_allocate(self.blocks.blocks_for(seq.n_tokens + n) - len(seq.table)):
            return 0
        return max(n, 0)

    def _verified(self, chunk: ScheduledChunk, accepted: int) -> int:
        """Proposed tokens whose K/V count as computed after `accepted` of them were accepted. When
        all were, the last one's K/V is the target's only (a draft model never ran it), so it is left
        pending and runs again next step: target and draft caches then always hold the same
        positions, and a full block registered for prefix reuse holds both models' K/V. A feature
        draft took every row the target ran in the same step, and n-grams have no cache: all of them
        count, as do a decode burst's (no draft: the target ran every token the burst kept)."""
        return accepted if self.no_draft_cache or not self.lookahead else min(accepted, chunk.lookahead - 1)

    def _roll_back(self, seq: Sequence) -> None:
        """Free the blocks only rejected proposals used. Their positions were never counted as
        computed, so no prefix digest covers them; the rows left in kept blocks are overwritten
        before anything reads them (attention reads positions below each token's own)."""
        keep = self.blocks.blocks_for(seq.n_tokens)
        if len(seq.table) > keep:
            self.blocks.release(seq.table[keep:])
            del seq.table[keep:]

    # --- internals --------------------------------------------------------------------------------
    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        grammar = seq.constraint
        if grammar is not None and grammar.failed:
            return "error"
        if token in seq.stop_ids or (grammar is not None and grammar.done):  # a complete grammar ends it
            return "stop"
        if len(seq.generated) >= seq.max_tokens or seq.n_tokens >= self.max_context:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._release_slot(seq)
        self.blocks.release(seq.table)
        seq.table, seq.registered = [], None
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _next_waiting(self) -> Sequence:
        """Fairness: the first waiting sequence of the client with the fewest running ones."""
        running = Counter(s.client for s in self.running)
        ready = [s for s in self.waiting if not s.held]
        return min(ready, key=lambda s: running[s.client])  # min() keeps the earliest of equals

    def _admit(self, seq: Sequence, budget: int) -> int:
        if not seq.table and not seq.prompt_logits:  # its every position's logits must be computed
            seq.table = self.blocks.match_prefix(seq.tokens, seq.prefix_root)
            seq.n_computed = len(seq.table) * self.blocks.block_size
        length = min(seq.pending, budget)
        if not self.blocks.can_allocate(self.blocks.blocks_for(seq.n_computed + length) - len(seq.table)):
            length = (len(seq.table) + self.blocks.num_free) * self.blocks.block_size - seq.n_computed
        length = self._cut(seq, length)
        if length <= 0:
            # waiting sequences hold no blocks (else they could starve the running ones); the
            # matched blocks stay cached, so the match is found again next time
            self.blocks.release(seq.table)
            seq.table, seq.n_computed, seq.registered = [], 0, None
            return 0
        seq.table += self.blocks.allocate(self.blocks.blocks_for(seq.n_computed + length) - len(seq.table))
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.state_slot = self._free_slots.pop()
        seq.status = Status.RUNNING
        if seq.started is None:
            seq.started = time.perf_counter()
        return length

    def _cut(self, seq: Sequence, length: int) -> int:
        """`length` tokens of seq, or fewer so that a run stopping short of its end stops at a
        multiple of `align` positions (0: no such piece fits)."""
        if self.align == 1 or length >= seq.pending:
            return length
        end = seq.n_computed + length
        return max(0, end - end % self.align - seq.n_computed)

    def _swap_out_held(self) -> None:
        """Held sequences give their running slots to runnable waiting ones: a client that does not
        read must not keep others from running. They wait again, keeping their place at the head of
        the queue, and are recomputed when their client reads (their full blocks usually come back
        from the prefix cache)."""
        runnable = sum(not s.held for s in self.waiting)
        free = self.max_running - len(self.running)
        for seq in sorted((s for s in self.running if s.held and not s.in_flight), key=lambda s: -s.seq_id):
            if runnable <= free:
                return
            self._preempt(seq)
            free += 1

    def _grow(self, seq: Sequence, n_tokens: int) -> bool:
        """Give seq blocks for n_tokens positions, preempting held sequences first, then younger
        ones, if memory is short. False if seq itself had to be preempted."""
        needed = self.blocks.blocks_for(n_tokens) - len(seq.table)
        while not self.blocks.can_allocate(needed):
            victim = max((s for s in self.running if not s.in_flight), key=lambda s: (s.held, s.seq_id))
            self._preempt(victim)
            if victim is seq:
                return False
        seq.table += self.blocks.allocate(needed)
        return True

    def _release_slot(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._release_slot(seq)
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.table, seq.n_computed, seq.registered = [], 0, None
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
