"""EngineCore: many sequences generated together — schedule a step, hand it to the executor, account
the results. It is the only generation path: the daemon's engine loop steps one per model, and
`Model.generate` / `Model.logits` step a private one holding a single sequence.

One step loop (step()), as in vLLM V1's step_with_batch_queue: while the executor has room
(`depth`: one step on a single device, one per stage of a layer split), the scheduler picks each
runnable sequence's next tokens (runner-independent) and the step goes to the executor as plain data
(StepWork: no Sequence crosses); then the oldest step that is through comes back, and the scheduler
appends its tokens and decides which sequences end. What a step does beyond one forward pass is a
field of its work, carried out behind the executor (daemon/executor/): with a draft model
(speculative decoding, daemon/speculative/) the draft reads the same chunks and proposes tokens
after each sampling chunk the scheduler gave lookahead, and the target verifies them in the same
pass (so a step may add several tokens to a sequence); without one, a decode step may run several
decode steps in a row (a decode burst, engine/decode_burst.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from ember.daemon.engine.block_manager import BlockManager
from ember.daemon.engine.decode_burst import MAX_BURST, BurstClock
from ember.daemon.engine.scheduler import ScheduledChunk, Scheduler, StepPlan
from ember.daemon.engine.sequence import Sequence, Status
from ember.daemon.executor.executor import Executor, executor_for
from ember.daemon.executor.step_failed import StepFailed
from ember.daemon.runner.step_run import KVStateLost
from ember.daemon.runner.step_runner import StepRunner
from ember.daemon.speculative.draft_proposer import DRAFT_MIN_PROB, DraftProposer
from ember.daemon.speculative.feature_proposer import FeatureProposer
from ember.daemon.speculative.ngram_proposer import NgramProposer, proposes
from ember.daemon.speculative.spec_stats import SpecStats
from ember.daemon.speculative.spec_switch import SpecSwitch
from ember.daemon.step.step_work import StepOutcome, StepWork, WorkChunk
from ember.daemon.text.grammar import Grammars


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


@dataclass
class _Flight:
    """A step handed to the executor, not yet accounted."""
    plan: StepPlan
    work: StepWork  # the plan as the executor took it
    before: list[int]  # per chunk: its tokens generated before the step (-1: it samples none)
    start: float  # perf_counter() at its submit
    running: int  # sequences running and waiting when its mode was chosen (the SpecSwitch's batch class)
    decodes: bool  # every chunk samples a generated token's successor (no prompt in it)


class EngineCore:
    def __init__(self, runner: StepRunner, max_step_tokens: int = 256, max_running: int = 64,
                 prefix_caching: bool = True, max_context: int | None = None,
                 draft: StepRunner | FeatureProposer | NgramProposer | None = None, draft_tokens: int = 4,
                 spec_stats: SpecStats | None = None, draft_min_prob: float = DRAFT_MIN_PROB,
                 decode_burst: float = 0.0, max_burst: int = MAX_BURST, grammars: Grammars | None = None,
                 burst_clock: BurstClock | None = None, spec_switch: SpecSwitch | None = None,
                 adaptive_draft: bool = True) -> None:
        """max_context: tokens per sequence at most (default and upper bound: the model's context).
        draft: a runner of the draft model whose KV cache has as many blocks, of the same size, as
        the target's; each sequence then gets up to draft_tokens proposals a step, fewer where the
        draft is unsure (DraftProposer's min_prob = draft_min_prob), counted in spec_stats (a new
        SpecStats if not given). Or a feature-conditioned draft built over `runner`
        (FeatureProposer): at most its block less one proposals a step, all from one pass. Or an
        NgramProposer (prompt lookup, no model): up to draft_tokens copied from a sequence's own
        context, in the steps where some sequence has a match.
        adaptive_draft (a draft model or n-grams, not a feature draft): each decode step speculates or decodes
        plainly (decode bursts included) as `spec_switch` finds faster from the steps it measured
        (daemon/speculative/spec_switch.py; a new SpecSwitch if None, Model.engine passes its
        model's); the draft catches up on the tokens it missed when speculation resumes. False:
        every step speculates.

        decode_burst: seconds a step may spend decoding in one go. While every runnable sequence
        decodes and nobody waits, a step then runs up to max_burst decode steps back to back (a
        decode burst, executor/burst.py), as many as fit in that time at the rate of the steps
        before: the engine's host work once for them all, the tokens those of single steps. 0: one
        token a step. Through a pipelined layer split the lanes' bursts interleave
        (executor/pipeline_executor.py). Not with a feature draft (its lookahead is the proposals'),
        with a draft model only in the steps that do not speculate, not with recurrent state.
        burst_clock: a BurstClock shared with earlier engines of the same model (for decode_burst and
        max_burst: Model.engine passes its own), so that a new engine's first burst is sized from
        their steps instead of starting at one step.

        grammars: the model's (daemon/text/grammar.py), for sequences with a grammar to follow.

        A hybrid model (runner.stateful) runs without prefix reuse: cached KV blocks would skip the
        tokens whose recurrent state the sequence still needs (docs/hybrid.md); nor with a draft
        (rejected proposals would have to be taken out of the recurrent state)."""
        if (runner.stateful or not runner.prefix_reuse) and max_running > runner.max_sequences:
            raise ValueError(f"max_running {max_running} exceeds the runner's {runner.max_sequences} sequence slots "
                             "(recurrent state slots, window rings)")
        feature = isinstance(draft, FeatureProposer)
        if draft is not None and (runner.stateful or getattr(draft, "stateful", False)):
            raise ValueError("speculative decoding needs attention-only models (no recurrent state)")
        self.runner = runner
        self.blocks = BlockManager(runner.kv_blocks, runner.block_size, prefix_caching and runner.prefix_reuse)
        context = min(max_context or runner.config.context_length, runner.config.context_length)
        self.proposer: DraftProposer | FeatureProposer | NgramProposer | None = None
        self.spec_stats = spec_stats or SpecStats()
        if draft is not None:
            if draft_tokens < 1:
                raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
            if isinstance(draft, NgramProposer):
                self.proposer = draft
            elif (draft.kv_blocks, draft.block_size) != (runner.kv_blocks, runner.block_size):
                raise ValueError("the draft's KV cache must have the target's blocks and block size")
            elif isinstance(draft, FeatureProposer):
                if draft.target is not runner:
                    raise ValueError("a feature draft must be built over the engine's own runner")
                self.proposer, draft_tokens = draft, min(draft_tokens, draft.max_proposals)
            else:
                self.proposer = DraftProposer(draft, runner.config.vocab, draft_min_prob)
        self.executor: Executor = executor_for(runner, self.proposer, self.spec_stats)
        lookahead = draft_tokens if draft is not None else 0
        self._draft_tokens = lookahead
        adaptive = adaptive_draft and isinstance(self.proposer, (DraftProposer, NgramProposer)) and self.executor.depth == 1
        self.spec_switch: SpecSwitch | None = (spec_switch or SpecSwitch()) if adaptive else None
        self._speculating = draft is not None  # the mode of the step being scheduled (and of _work)
        # aligned prompt runs only where decodes can never take the whole budget (else prompts could wait forever)
        align = runner.step_alignment if max_step_tokens >= runner.step_alignment + max_running else 1
        self.scheduler = Scheduler(self.blocks, max_step_tokens, max_running, context, lookahead, align,
                                   feature or isinstance(self.proposer, NgramProposer))
        self._flights: dict[int, _Flight] = {}  # id(work) -> its step, while the executor has it
        # (n-grams have no draft to catch up after plain steps, so their steps may burst with or without the switch)
        bursts = (draft is None or self.spec_switch is not None or isinstance(self.proposer, NgramProposer)) \
            and not runner.stateful
        self._bursts = burst_clock if bursts and burst_clock is not None else BurstClock(decode_burst if bursts else 0.0,
                                                                                          max_burst)
        self._lookup_bursts = self._bursts.seconds > 0 and isinstance(self.proposer, NgramProposer)
        self._lookup = False  # the step being scheduled is an n-gram lookup burst (_choose_mode)
        self.grammars = grammars

    def add(self, seq: Sequence) -> None:
        """Schedule `seq`; ValueError (GrammarError for its grammar) if it cannot run here."""
        seq.params.check_vocab(self.runner.config.vocab)
        if seq.grammar is not None and seq.constraint is None:
            if self.grammars is None:
                raise ValueError("this engine has no grammars (constrained decoding needs the model's tokenizer)")
            seq.sampling.constraint = self.grammars.constraint(seq.grammar)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        if seq.in_flight:  # its blocks go back now: a burst of its step must not write to them again
            for flight in self._flights.values():
                if any(c.seq is seq for c in flight.plan.chunks):
                    self.executor.cut(flight.work)
        self.scheduler.abort(seq, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._flights)

    def step(self) -> StepResult:
        """One step (_step), with the calling thread on the runner's device: whichever thread drives
        the engine (the engine process's, a caller's in process) launches there."""
        with self.runner.device_scope():
            return self._step()

    def _step(self) -> StepResult:
        """Fill the executor with steps, then account the first one that is through: its outputs are
        the sequences that got new tokens, logits or finished.

        A sequence whose sampling fails ends with reason "error" (StepResult.failed) and the others go
        on. If a step fails as a whole, each of its chunks is run alone: the ones that fail alone
        end with "error", the others' work stands — one request cannot end its neighbours'. A runner
        that lost its KV cache (KVStateLost: a layer-split stage died) ends every running sequence
        with "error" and forgets the cached prefixes; waiting ones run later as usual. Idle (nothing
        running), the executor first restarts the workers that died since the last step: a death
        while idle fails no request."""
        plan = StepPlan([])
        try:
            if not self._flights and not self.scheduler.running:
                self._revive()
            while len(self._flights) < self.executor.depth:
                running = self._choose_mode()
                self.scheduler.decode_lookahead = self._bursts.size() - 1
                plan = self.scheduler.schedule(max_seqs=self._share())
                if not plan.chunks:
                    break
                if plan.started:  # a request boundary: where a MoE model may swap experts, never inside a step
                    self.executor.between_requests()
                work = self._work(plan)
                try:
                    self.executor.submit(work)
                except KVStateLost:
                    raise
                except Exception as e:  # refused before it ran: find whose it was, in step
                    outputs, failed = self._isolate(plan, e)
                    return StepResult(plan.n_tokens, outputs, plan.started, failed)
                self._flights[id(work)] = self._flight(plan, work, running)
            if not self._flights:
                return StepResult(0)
            try:
                work, outcome = self.executor.collect()
            except StepFailed as e:
                plan = self._landed(e.work).plan
                outputs, failed = self._isolate(plan, e.error)
                return StepResult(plan.n_tokens, outputs, plan.started, failed)
            flight = self._landed(work)
            plan = flight.plan
            if work.steps:
                self._bursts.timed(time.perf_counter() - flight.start, max(1, outcome.steps))
            try:
                outputs, failed = self._account(plan, flight.before, outcome)
            except KVStateLost:
                raise
            except Exception as e:
                outputs, failed = self._isolate(plan, e)
            else:
                self._measured(flight)
            return StepResult(plan.n_tokens, outputs, plan.started, failed)
        except KVStateLost as e:
            for flight in self._flights.values():
                for chunk in flight.plan.chunks:
                    chunk.seq.in_flight = False
            self._flights.clear()
            # tokens: the step that found the loss (0 would read as "nothing ran" to the daemon)
            return StepResult(max(1, plan.n_tokens), [], plan.started, self._lose_state(str(e)))

    def _share(self) -> int | None:
        """Sequences one step may hold: all on one device; with several steps in flight, an even
        share of the work, so that each lane gets some."""
        if self.executor.depth == 1:
            return None
        return max(1, -(-(len(self.scheduler.running) + len(self.scheduler.waiting)) // self.executor.depth))

    def _work(self, plan: StepPlan) -> StepWork:
        """The plan as the executor takes it: plain data, and the decode steps it may run. In a step
        that speculates, a sequence whose draft fell behind (steps ran without it) has the tokens the
        draft missed go first; in one that does not, the draft falls behind from the chunk on."""
        chunks = [WorkChunk(c.seq.tokens[c.start : c.start + c.length], c.start, c.seq.table, c.lookahead,
                            len(c.seq.prompt), c.seq.sampling, c.samples, c.seq.state_slot, c.seq.prompt_logits,
                            c.seq.wants_logits, self._missed(c)) for c in plan.chunks]
        steps = self._decode_steps(plan)
        return StepWork(chunks, steps, propose=self._speculating, lookup=self._draft_tokens if self._lookup and steps else 0)

    def _missed(self, chunk: ScheduledChunk) -> list[int]:
        """The tokens before `chunk` that the draft has not read, where this step speculates."""
        seq = chunk.seq
        if self.spec_switch is None or not self.proposer.catches_up:
            return []
        if not self._speculating:  # (a chunk before draft_pos: the sequence was preempted and runs again)
            seq.draft_pos = chunk.start if seq.draft_pos is None else min(seq.draft_pos, chunk.start)
            return []
        if seq.draft_pos is None:
            return []
        return seq.tokens[min(seq.draft_pos, chunk.start) : chunk.start]

    def _choose_mode(self) -> int:
        """Whether the step about to be scheduled speculates (the SpecSwitch's choice for the
        sequences running and waiting now, where it has one): the scheduler's lookahead follows. -> their
        number."""
        running = len(self.scheduler.running) + len(self.scheduler.waiting)  # the batch it may be
        speculate, seeded = self.proposer is not None, self._seeded()
        if self.spec_switch is not None:
            behind = sum(max(0, s.n_computed - s.draft_pos) for s in self.scheduler.running if s.draft_pos is not None)
            speculate = self.spec_switch.speculate(running, behind) or seeded
        if speculate and not seeded:  # n-grams: where nothing matches, the step decodes plainly
            speculate = proposes(self.proposer, [(s.sampling, len(s.tokens)) for s in self.scheduler.running])
        # one greedy sequence and n-grams: a decode burst that verifies proposals in its compiled loop
        self._lookup = speculate and self._lookup_bursts and not self.scheduler.waiting and \
            len(self.scheduler.running) == 1 and self.scheduler.running[0].sampling.plain_greedy
        self._speculating = speculate and not self._lookup
        self.scheduler.lookahead = self._draft_tokens if self._speculating else 0
        return running

    def _seeded(self) -> bool:
        """A seeded sampled request is running or waiting: its steps speculate whatever the switch
        measured, since verification draws its random numbers otherwise than plain sampling, and the
        seed must give the same tokens however fast each mode ran (greedy requests give the same
        tokens in either mode)."""
        return any(s.seed is not None and not s.params.greedy
                   for s in (*self.scheduler.running, *self.scheduler.waiting))

    def _flight(self, plan: StepPlan, work: StepWork, running: int) -> _Flight:
        for chunk in plan.chunks:
            chunk.seq.in_flight = True
        # (after the step a chunk no longer samples: its sequence has the token)
        decodes = bool(plan.chunks) and all(c.samples and c.start >= len(c.seq.prompt) for c in plan.chunks)
        return _Flight(plan, work, _generated_before(plan), time.perf_counter(), running, decodes)

    def _measured(self, flight: _Flight) -> None:
        """Tell the SpecSwitch how a decode step went (a step with prompt tokens says nothing of
        either mode's rate); a speculative one has caught its draft up."""
        if self.spec_switch is None:
            return
        chunks, speculative = flight.plan.chunks, flight.work.propose or bool(flight.work.lookup)
        if speculative:
            for chunk in chunks:
                chunk.seq.draft_pos = None
        if not flight.decodes:
            return
        tokens = sum(len(c.seq.generated) - before for c, before in zip(chunks, flight.before, strict=True))
        catch_up = any(c.draft_prefix for c in flight.work.chunks)
        self.spec_switch.record(flight.running, speculative, time.perf_counter() - flight.start, tokens, catch_up)
        if not speculative:
            self.spec_stats.plain_tokens += tokens
        self.spec_stats.spec_s_per_token, self.spec_stats.plain_s_per_token = self.spec_switch.rates(flight.running)

    def _landed(self, work: StepWork) -> _Flight:
        """The flight of a step the executor gave back: its sequences may be scheduled again."""
        flight = self._flights.pop(id(work))
        for chunk in flight.plan.chunks:
            chunk.seq.in_flight = False
        return flight

    def _decode_steps(self, plan: StepPlan) -> int:
        """How many decode steps the plan runs when it is a decode step (every chunk one token that
        samples, no draft: timed for the burst size), 0 when it is not: a burst where every chunk
        has slots for one."""
        if self._speculating or not all(c.samples and c.length == 1 for c in plan.chunks):
            return 0
        return 1 + min(c.lookahead for c in plan.chunks)

    def _run_alone(self, plan: StepPlan) -> tuple[list[StepOutput], list[tuple[Sequence, str]]]:
        return self._account(plan, _generated_before(plan), self.executor.run(self._work(plan)))

    def _revive(self) -> None:
        """Idle, before new work: the executor restarts the workers that died since the last step."""
        try:
            if self.executor.revive():
                self.blocks.forget_prefixes()  # a worker that died while idle took the cached prefixes' KV
        except KVStateLost:
            pass  # they could not be restarted: the step finds them down and fails what it runs, saying why

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

    def _account(self, plan: StepPlan, before: list[int], outcome: StepOutcome
                 ) -> tuple[list[StepOutput], list[tuple[Sequence, str]]]:
        if outcome.proposed:  # the draft may stop short of the lookahead: the step verified what it proposed
            plan = replace(plan, chunks=[replace(c, lookahead=outcome.proposed[i]) if i in outcome.proposed else c
                                         for i, c in enumerate(plan.chunks)])
        sampling = [c.seq for c in plan.chunks if c.samples]
        # (one cancelled while its step ran has ended already: it fails no more)
        failed = [(sampling[k], message) for k, message in outcome.failed.items()
                  if sampling[k].status != Status.FINISHED]
        for seq, _ in failed:
            self.scheduler.abort(seq, "error")  # update() skips it, and its choice is not passed on
        # a sequence ended meanwhile (sampling failed; cancelled while a pipelined step ran) takes no token
        choices = [c for seq, c in zip(sampling, outcome.choices, strict=True)
                   if c is not None and seq.status == Status.RUNNING]
        finished = set(map(id, self.scheduler.update(plan, choices)))
        outputs = []
        for i, chunk in enumerate(plan.chunks):
            seq, done = chunk.seq, id(chunk.seq) in finished
            if seq.status == Status.FINISHED and not done:
                continue
            new = seq.generated[before[i]:] if before[i] >= 0 else []
            logits = outcome.logits.get(i)
            if logits is not None and seq.prompt_logits:  # after a preemption, positions are computed again
                logits = logits[max(0, seq.logits_returned - chunk.start):]
                seq.logits_returned = max(seq.logits_returned, chunk.start + chunk.length)
                logits = logits if len(logits) else None
            if new or done or logits is not None:
                outputs.append(StepOutput(seq, new, done, logits))
        return outputs, failed

    def _isolate(self, plan: StepPlan, error: Exception) -> tuple[list[StepOutput], list[tuple[Sequence, str]]]:
        """The step failed as a whole: run each chunk alone to find whose it was."""
        if len(plan.chunks) == 1:  # nobody else to spare: it was this one's (unless it was cancelled meanwhile)
            seq = plan.chunks[0].seq
            if seq.status == Status.FINISHED:
                return [], []
            self.scheduler.abort(seq, "error")
            return [], [(seq, f"{type(error).__name__}: {error}")]
        outputs: list[StepOutput] = []
        failed: list[tuple[Sequence, str]] = []
        for chunk in plan.chunks:
            if chunk.seq.status != Status.RUNNING:
                continue  # cancelled while the step ran
            try:
                for alone in self._replayed(chunk):
                    more, bad = self._run_alone(StepPlan([alone]))
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


def _generated_before(plan: StepPlan) -> list[int]:
    """Per chunk, its sequence's generated tokens before the step (-1: it samples none): what the
    step's outputs are cut from after update() appends."""
    return [len(c.seq.generated) if c.samples else -1 for c in plan.chunks]
