"""EngineCore: many sequences generated together — schedule a step, run it as one batch on the model
runner, account the results. It is the only generation path: the daemon's engine loop steps one per
model, and `Model.generate` / `Model.logits` step a private one holding a single sequence.

A step: the scheduler picks each running sequence's next tokens (runner-independent), the runner runs
them and samples on its device, the scheduler appends the tokens and decides which sequences end.
With a draft model (speculative decoding, daemon/speculative/) the draft first reads the same chunks
and proposes tokens after each sampling chunk the scheduler gave lookahead; the target runs them in
the same pass and keeps what verification accepts (so a step may add several tokens to a sequence).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ember.daemon.engine.block_manager import BlockManager
from ember.daemon.engine.decode_burst import MAX_BURST, BurstClock
from ember.daemon.engine.scheduler import ScheduledChunk, Scheduler, StepPlan
from ember.daemon.engine.sequence import Sequence, Status
from ember.daemon.runner.model_runner import KVStateLost, ModelRunner, PendingStep, StepRun
from ember.daemon.step.burst_blocks import BurstBlocks
from ember.daemon.step.draft_chunk import DraftChunk
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.speculative.draft_proposer import DRAFT_MIN_PROB, DraftProposer
from ember.daemon.speculative.feature_proposer import FeatureProposer
from ember.daemon.speculative.spec_stats import SpecStats
from ember.daemon.speculative.verification import Proposal, verify
from ember.kernels.sampling import Choice


@dataclass(frozen=True)
class StepOutput:
    seq: Sequence
    new_tokens: list[int]  # one per step, or a verified block with speculative decoding
    finished: bool
    # seq.wants_logits: [1, vocab] f32, the logits the new token was sampled from;
    # seq.prompt_logits: [k, vocab], the logits of every position this step computed for the first time
    logits: np.ndarray | None = None


@dataclass(frozen=True)
class StepResult:
    tokens: int  # tokens run through the model (0: nothing was runnable)
    outputs: list[StepOutput] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)  # sequences that ran for the first time
    failed: list[tuple[Sequence, str]] = field(default_factory=list)  # ended by an error of their own (why)


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_queries: int  # full prompt blocks looked up in the prefix cache
    prefix_hits: int  # of those, found
    preemptions: int
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding (zeros without a draft)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class EngineCore:
    def __init__(self, runner: ModelRunner, max_step_tokens: int = 256, max_running: int = 64,
                 prefix_caching: bool = True, max_context: int | None = None,
                 draft: ModelRunner | FeatureProposer | None = None, draft_tokens: int = 4,
                 spec_stats: SpecStats | None = None, draft_min_prob: float = DRAFT_MIN_PROB,
                 decode_burst: float = 0.0, max_burst: int = MAX_BURST) -> None:
        """max_context: tokens per sequence at most (default and upper bound: the model's context).
        draft: a runner of the draft model whose KV cache has as many blocks, of the same size, as
        the target's; each sequence then gets up to draft_tokens proposals a step, fewer where the
        draft is unsure (DraftProposer's min_prob = draft_min_prob), counted in spec_stats (a new
        SpecStats if not given). Or a feature-conditioned draft built over `runner`
        (FeatureProposer): at most its block less one proposals a step, all from one pass.

        decode_burst: seconds a step may spend decoding in one go. While every runnable sequence
        decodes and nobody waits, a step then runs up to max_burst decode steps back to back (a
        decode burst, ModelRunner.decode), as many as fit in that time at the rate of the steps
        before: the engine's host work once for them all, the tokens those of single steps. 0: one
        token a step. A pipelined layer split runs a burst one step at a time, each step's tokens
        the next one's input, its lanes' bursts interleaved (_step_pipelined). Not with a draft (its
        lookahead is the proposals') or recurrent state.

        A hybrid model (runner.stateful) runs without prefix reuse: cached KV blocks would skip the
        tokens whose recurrent state the sequence still needs (docs/hybrid.md); nor with a draft
        (rejected proposals would have to be taken out of the recurrent state)."""
        if runner.stateful and max_running > runner.max_sequences:
            raise ValueError(f"max_running {max_running} exceeds the runner's {runner.max_sequences} recurrent state slots")
        feature = isinstance(draft, FeatureProposer)
        if draft is not None and (runner.stateful or (not feature and draft.stateful)):
            raise ValueError("speculative decoding needs attention-only models (no recurrent state)")
        self.runner = runner
        self.blocks = BlockManager(runner.kv_blocks, runner.block_size, prefix_caching and not runner.stateful)
        context = min(max_context or runner.config.context_length, runner.config.context_length)
        self.proposer: DraftProposer | FeatureProposer | None = None
        self.spec_stats = spec_stats or SpecStats()
        if draft is not None:
            if (draft.kv_blocks, draft.block_size) != (runner.kv_blocks, runner.block_size):
                raise ValueError("the draft's KV cache must have the target's blocks and block size")
            if draft_tokens < 1:
                raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
            if isinstance(draft, FeatureProposer):
                if draft.target is not runner:
                    raise ValueError("a feature draft must be built over the engine's own runner")
                self.proposer, draft_tokens = draft, min(draft_tokens, draft.max_proposals)
            else:
                self.proposer = DraftProposer(draft, runner.config.vocab, draft_min_prob)
        lookahead = draft_tokens if draft is not None else 0
        # aligned prompt runs only where decodes can never take the whole budget (else prompts could wait forever)
        align = runner.step_alignment if max_step_tokens >= runner.step_alignment + max_running else 1
        self.scheduler = Scheduler(self.blocks, max_step_tokens, max_running, context, lookahead, align, feature)
        self._in_flight: deque[_Flight] = deque()  # steps submitted to a pipelined runner, oldest first
        bursts = draft is None and not runner.stateful
        self._bursts = BurstClock(decode_burst if bursts else 0.0, max_burst)

    def add(self, seq: Sequence) -> None:
        seq.params.check_vocab(self.runner.config.vocab)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        self.scheduler.abort(seq, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._in_flight)

    def step(self) -> StepResult:
        """One forward pass; its outputs are the sequences that got a new token, logits or finished.

        A sequence whose sampling fails ends with reason "error" (StepResult.failed) and the others go
        on. If the forward pass itself fails, each chunk of the step is run alone: the ones that fail
        alone end with "error", the others' work stands — one request cannot end its neighbours'.
        A runner that lost its KV cache (KVStateLost: a layer-split stage died) ends every running
        sequence with "error" and forgets the cached prefixes; waiting ones run later as usual."""
        if self.runner.lanes > 1 and self.proposer is None:
            return self._step_pipelined()
        self.scheduler.decode_lookahead = self._bursts.size() - 1
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return StepResult(0)
        if plan.started:  # a request boundary: where a MoE model may swap experts, never inside a step
            self.runner.between_requests()
        try:
            try:
                outputs, failed = self._step(plan)
            except KVStateLost:
                raise
            except Exception as e:
                outputs, failed = self._isolate(plan, e)
        except KVStateLost as e:
            outputs, failed = [], self._lose_state(str(e))
        return StepResult(plan.n_tokens, outputs, plan.started, failed)

    def _step_pipelined(self) -> StepResult:
        """A runner that takes several steps at once (a layer split: one per stage) gets that many,
        each on sequences of its own, so that while one runs on its last stage the next runs on its
        first; the oldest is collected. A decode burst's flight goes round again with its next step
        (the tokens just sampled as its input, no scheduling, no accounting) until its burst is
        through, and is accounted then; every sequence still takes one step at a time."""
        plan = StepPlan([])
        try:
            while len(self._in_flight) < self.runner.lanes:
                self.scheduler.decode_lookahead = self._bursts.size() - 1
                share = -(-(len(self.scheduler.running) + len(self.scheduler.waiting)) // self.runner.lanes)
                plan = self.scheduler.schedule(max_seqs=max(1, share))
                if not plan.chunks:
                    break
                if plan.started:
                    self.runner.between_requests()
                try:
                    self._in_flight.append(self._submit(plan))
                except KVStateLost:
                    raise
                except Exception as e:  # refused before it ran: find whose it was, in step
                    outputs, failed = self._isolate(plan, e)
                    return StepResult(plan.n_tokens, outputs, plan.started, failed)
            if not self._in_flight:
                return StepResult(0)
            flight = self._in_flight.popleft()
            plan = flight.plan
            for chunk in plan.chunks:
                chunk.seq.in_flight = False
            try:
                run = self._collect(flight)
                if run is None:  # a burst's next step is in flight
                    return StepResult(plan.n_tokens)
                outputs, failed = self._account(plan, flight.rows, flight.before, run)
            except KVStateLost:
                raise
            except Exception as e:
                outputs, failed = self._isolate(plan, e)
            return StepResult(plan.n_tokens, outputs, plan.started, failed)
        except KVStateLost as e:
            for flight in self._in_flight:
                for chunk in flight.plan.chunks:
                    chunk.seq.in_flight = False
            self._in_flight.clear()
            # tokens: the step that found the loss (0 would read as "nothing ran" to the daemon)
            return StepResult(max(1, plan.n_tokens), [], plan.started, self._lose_state(str(e)))

    def _submit(self, plan: StepPlan) -> _Flight:
        rows = _LogitRows(plan, self.proposer is not None)
        before = [len(c.seq.generated) if c.samples else -1 for c in plan.chunks]  # before update() appends
        samplers = [(rows.last[i], c.seq.sampling) for i, c in enumerate(plan.chunks) if c.samples]
        batch = self._build(plan.chunks, rows, {})
        start = time.perf_counter()
        pending = self.runner.submit(batch, samplers, rows.keep)
        for chunk in plan.chunks:
            chunk.seq.in_flight = True
        steps = self._decode_steps(plan)
        return _Flight(plan, rows, before, pending, start, steps,
                       _PipelinedBurst(batch, BurstBlocks(samplers)) if steps > 1 else None)

    def _collect(self, flight: _Flight) -> StepRun | None:
        """A pipelined flight's step. A burst's step that is not its last starts the next one (None):
        the flight goes to the back of the queue, its sequences in flight again."""
        burst = flight.burst
        if burst is None:
            run = self.runner.collect(flight.pending)
            if flight.steps:
                self._bursts.timed(time.perf_counter() - flight.start, 1)
            return run
        run = self.runner.collect(flight.pending, burst.blocks.blocks)
        burst.blocks.take(run.choices, run.failed)
        # a sequence cancelled meanwhile has given its blocks back: nothing more may be written to them
        going = all(c.seq.status == Status.RUNNING for c in flight.plan.chunks)
        if burst.blocks.steps < flight.steps and not burst.blocks.finished and going:
            burst.batch = burst.batch.following(burst.blocks.last_ids(), self.runner.block_size)
            flight.pending = self.runner.submit(burst.batch, burst.blocks.samplers)
            for chunk in flight.plan.chunks:
                chunk.seq.in_flight = True
            self._in_flight.append(flight)
            return None
        self._bursts.timed(time.perf_counter() - flight.start, burst.blocks.steps)
        choices, failed = burst.blocks.result()
        return StepRun(choices, {}, failed)  # type: ignore[arg-type]

    def _lose_state(self, why: str) -> list[tuple[Sequence, str]]:
        lost = list(self.scheduler.running)
        for seq in lost:
            self.scheduler.abort(seq, "error")
        self.blocks.forget_prefixes()  # their blocks' contents are gone
        return [(seq, why) for seq in lost]

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_blocks_used=self.blocks.n_blocks - self.blocks.num_free, kv_blocks_free=self.blocks.num_free,
            prefix_queries=self.blocks.stats.prefix_queries, prefix_hits=self.blocks.stats.prefix_hits,
            preemptions=self.scheduler.preemptions, spec=replace(self.spec_stats),
        )

    def _step(self, plan: StepPlan) -> tuple[list[StepOutput], list[tuple[Sequence, str]]]:
        proposals = self.proposer.propose(_draft_chunks(plan)) if self.proposer else {}
        if proposals:  # the draft may stop short of the lookahead: the step verifies what it proposed
            plan = replace(plan, chunks=[replace(c, lookahead=len(proposals[i].tokens)) if i in proposals else c
                                         for i, c in enumerate(plan.chunks)])
        rows = _LogitRows(plan, self.proposer is not None)
        before = [len(c.seq.generated) if c.samples else -1 for c in plan.chunks]  # before update() appends
        steps = self._decode_steps(plan)
        if not steps:
            return self._account(plan, rows, before, self._run(plan, rows, proposals))
        start = time.perf_counter()
        # (a single step too, unless logits go to clients: the runner's decode may take it in one call)
        run = self._run(plan, rows, {}) if steps == 1 and rows.keep else self._burst_run(plan, rows, steps)
        self._bursts.timed(time.perf_counter() - start, steps)
        return self._account(plan, rows, before, run)

    def _decode_steps(self, plan: StepPlan) -> int:
        """How many decode steps the plan runs when it is a decode step (every chunk one token that
        samples, no draft: timed for the burst size), 0 when it is not: a burst where every chunk
        has slots for one."""
        if self.proposer is not None or not all(c.samples and c.length == 1 for c in plan.chunks):
            return 0
        return 1 + min(c.lookahead for c in plan.chunks)

    def _burst_run(self, plan: StepPlan, rows: _LogitRows, steps: int) -> StepRun:
        """`steps` decode steps of the plan's sequences in one go (their slots reserved by the
        scheduler): one block of tokens each; update() then drops what follows a stop."""
        samplers = [(rows.last[i], c.seq.sampling) for i, c in enumerate(plan.chunks)]
        return self.runner.decode(self._build(plan.chunks, rows, {}), samplers, steps)

    def _account(self, plan: StepPlan, rows: _LogitRows, before: list[int], run: StepRun
                 ) -> tuple[list[StepOutput], list[tuple[Sequence, str]]]:
        sampling = [c.seq for c in plan.chunks if c.samples]
        failed = [(sampling[k], message) for k, message in run.failed.items()]
        for seq, _ in failed:
            self.scheduler.abort(seq, "error")  # update() skips it, and its choice is not passed on
        # a sequence ended meanwhile (sampling failed; cancelled while a pipelined step ran) takes no token
        choices = [c for seq, c in zip(sampling, run.choices, strict=True) if c is not None and seq.status == Status.RUNNING]
        finished = set(map(id, self.scheduler.update(plan, choices)))
        outputs = []
        for i, chunk in enumerate(plan.chunks):
            seq, done = chunk.seq, id(chunk.seq) in finished
            if seq.status == Status.FINISHED and not done:
                continue
            new = seq.generated[before[i]:] if before[i] >= 0 else []
            logits = rows.kept_logits(i, run)
            if logits is not None and seq.prompt_logits:  # after a preemption, positions are computed again
                logits = logits[max(0, seq.logits_returned - chunk.start):]
                seq.logits_returned = max(seq.logits_returned, chunk.start + chunk.length)
                logits = logits if len(logits) else None
            if new or done or logits is not None:
                outputs.append(StepOutput(seq, new, done, logits))
        return outputs, failed

    def _isolate(self, plan: StepPlan, error: Exception) -> tuple[list[StepOutput], list[tuple[Sequence, str]]]:
        """The step failed as a whole: run each chunk alone to find whose it was."""
        if len(plan.chunks) == 1:  # nobody else to spare: it was this one's
            seq = plan.chunks[0].seq
            self.scheduler.abort(seq, "error")
            return [], [(seq, f"{type(error).__name__}: {error}")]
        outputs: list[StepOutput] = []
        failed: list[tuple[Sequence, str]] = []
        for chunk in plan.chunks:
            try:
                for alone in self._replayed(chunk):
                    more, bad = self._step(StepPlan([alone]))
            except KVStateLost:
                raise
            except Exception as e:
                self.scheduler.abort(chunk.seq, "error")
                more, bad = [], [(chunk.seq, f"{type(e).__name__}: {e}")]
            outputs += more
            failed += bad
        return outputs, failed

    def _replayed(self, chunk: ScheduledChunk) -> list[ScheduledChunk]:
        """`chunk` to run again alone. A stateful runner's failed step may have advanced the sequence's
        recurrent state part-way, so its tokens are run again from position 0 (which resets the state),
        in steps of the usual size; the KV blocks they rewrite get the same values."""
        if not self.runner.stateful:
            return [chunk]
        end, size, align = chunk.start + chunk.length, self.scheduler.max_step_tokens, self.scheduler.align
        size = max(align, size - size % align)  # runs cut where the scheduler would cut them
        return [ScheduledChunk(chunk.seq, s, min(size, end - s)) for s in range(0, end, size)]

    def _build(self, chunks: list[ScheduledChunk], rows: _LogitRows, proposals: dict[int, Proposal]) -> StepBatch:
        return StepBatch.build(
            [(c.seq.tokens[c.start : c.start + c.length] + (proposals[i].tokens if i in proposals else []),
              c.start, c.seq.table) for i, c in enumerate(chunks)],
            self.runner.block_size, all_logits=[c.seq.prompt_logits for c in chunks],
            wants_logits=[c.samples for c in chunks], prompt_lengths=[len(c.seq.prompt) for c in chunks],
            state_slots=[c.seq.state_slot for c in chunks], logit_tails=rows.count if proposals else None,
        )

    def _run(self, plan: StepPlan, rows: _LogitRows, proposals: dict[int, Proposal]) -> StepRun:
        chunks = plan.chunks
        batch = self._build(chunks, rows, proposals)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        samplers = [(rows.last[i], chunks[i].seq.sampling) for i in sampling if i not in proposals]
        run = self.runner.execute(batch, samplers, rows.keep + rows.verified)
        if isinstance(self.proposer, FeatureProposer):
            self.proposer.absorb(batch, run)  # every row's features, before any position counts as computed
        if not proposals:
            return run
        # one entry per sampling chunk again: the runner's samples, and the verified blocks in between
        sampled, choices, failed = iter(run.choices), [], {}
        plain = iter(range(len(samplers)))
        for k, i in enumerate(sampling):
            if i not in proposals:
                choices.append(next(sampled))
                if (j := next(plain)) in run.failed:
                    failed[k] = run.failed[j]
                continue
            first = rows.last[i] - len(proposals[i].tokens)
            try:
                block: tuple[Choice, ...] | None = verify(
                    np.stack([run.kept[r] for r in range(first, rows.last[i] + 1)]), proposals[i], chunks[i].seq.sampling)
            except (ValueError, FloatingPointError, ArithmeticError) as e:
                block, failed[k] = None, f"sampling failed: {type(e).__name__}: {e}"
            else:
                self.spec_stats.add(len(proposals[i].tokens), len(block) - 1)
            choices.append(block)
        return StepRun(choices, run.kept, failed)


def _draft_chunks(plan: StepPlan) -> list[DraftChunk]:
    """The plan's chunks as a proposer reads them."""
    return [DraftChunk(c.seq.tokens[c.start : c.start + c.length], c.start, c.seq.table, c.lookahead,
                       len(c.seq.prompt), c.seq.sampling) for c in plan.chunks]


@dataclass
class _PipelinedBurst:
    """A pipelined flight's decode burst: its latest step's host batch, the tokens so far."""
    batch: StepBatch
    blocks: BurstBlocks


@dataclass
class _Flight:
    """A step submitted to a pipelined runner (a burst's steps, one after the other), not yet accounted."""
    plan: StepPlan
    rows: _LogitRows
    before: list[int]  # per chunk: its tokens generated before the step (-1: it samples none)
    pending: PendingStep  # its step in the runner now
    start: float  # perf_counter() at its first submit
    steps: int  # decode steps it runs (_decode_steps; 0: not a decode step)
    burst: _PipelinedBurst | None = None


class _LogitRows:
    """Which logits row belongs to which chunk: a prompt-logits chunk has a row per token, a sampling
    chunk one (its last token) and one per proposed token after it, others none; and which rows go
    back to the host: those asked for, and those to verify proposals against."""

    def __init__(self, plan: StepPlan, proposing: bool) -> None:
        """proposing: the plan's lookahead is for proposed tokens, each a logits row (else for a
        decode burst, whose later steps are batches of their own)."""
        self.first: list[int] = []
        self.last: list[int] = []
        self.count: list[int] = []
        self.keep: list[int] = []
        self.verified: list[int] = []
        self.returned: list[bool] = []  # per chunk: its rows go out in StepOutput.logits
        n = 0
        for c in plan.chunks:
            count = c.length if c.seq.prompt_logits else int(c.samples) * (1 + (c.lookahead if proposing else 0))
            self.first.append(n)
            self.last.append(n + count - 1)
            self.count.append(count)
            if c.seq.prompt_logits or (c.samples and c.seq.wants_logits):
                self.keep.extend(range(n, n + count))
            elif c.lookahead:
                self.verified.extend(range(n, n + count))
            self.returned.append(c.seq.prompt_logits or (c.samples and c.seq.wants_logits))
            n += count

    def kept_logits(self, i: int, run: StepRun) -> np.ndarray | None:
        rows = range(self.first[i], self.last[i] + 1)
        if not self.returned[i] or not rows or rows[0] not in run.kept:
            return None
        return np.stack([run.kept[r] for r in rows])

