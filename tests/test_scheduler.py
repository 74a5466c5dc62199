"""Scheduler with hand-made step results (no model): budgets, chunked prefill, admission by free
blocks, preemption that loses nothing, fairness between clients."""
from __future__ import annotations

import pytest

from ember.daemon.engine.block_manager import BlockManager
from ember.daemon.engine.scheduler import Scheduler
from ember.daemon.engine.sequence import Sequence, Status
from ember.kernels.sampling import Choice


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[list]:
    """Drive the scheduler, 'sampling' token 7 each time; returns each step's chunks."""
    steps = []
    while sched.has_work and len(steps) < max_steps:
        plan = sched.schedule()
        assert plan.chunks, "scheduler stalled with work pending"
        assert plan.n_tokens <= sched.max_step_tokens
        steps.append(plan.chunks)
        sched.update(plan, [Choice(7, 0.0) for c in plan.chunks if c.samples])
        sched.blocks.check_integrity([s.table for s in sched.running + list(sched.waiting)])
    return steps


def test_chunked_prefill_and_decode_within_budget() -> None:
    sched = Scheduler(BlockManager(64, 4), max_step_tokens=8)
    a, b = Sequence(list(range(1, 21)), max_tokens=3), Sequence([5, 6], max_tokens=3)
    sched.add(a)
    sched.add(b)
    steps = run_to_completion(sched)
    assert [(c.seq is a, c.start, c.length) for c in steps[0]] == [(True, 0, 8)]
    assert a.generated == [7, 7, 7] and b.generated == [7, 7, 7]
    assert a.finish_reason == b.finish_reason == "length"
    assert sched.blocks.num_free == 64


def test_decodes_go_before_prompt_chunks() -> None:
    sched = Scheduler(BlockManager(64, 4), max_step_tokens=4)
    a = Sequence([1, 2], max_tokens=10)
    sched.add(a)
    run_one = sched.schedule()
    sched.update(run_one, [Choice(7, 0.0)])
    sched.add(Sequence(list(range(1, 30)), max_tokens=1))
    plan = sched.schedule()
    assert plan.chunks[0].seq is a and plan.chunks[0].length == 1 and plan.chunks[1].length == 3


def test_stop_token_finishes() -> None:
    sched = Scheduler(BlockManager(8, 4))
    s = Sequence([1, 2, 3], max_tokens=100, stop_ids=frozenset({7}))
    sched.add(s)
    run_to_completion(sched)
    assert s.generated == [7] and s.finish_reason == "stop"


def test_kv_exhaustion_preempts_and_everything_finishes() -> None:
    # 12 blocks of 4 = 48 token slots for 6 sequences that each grow to 20 tokens (120 slots)
    sched = Scheduler(BlockManager(12, 4), max_step_tokens=32)
    seqs = [Sequence(list(range(1 + i, 11 + i)), max_tokens=10) for i in range(6)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert sched.preemptions > 0
    assert all(s.status == Status.FINISHED and s.generated == [7] * 10 for s in seqs)
    assert sched.blocks.num_free == 12


def test_fairness_admits_the_client_with_fewer_running() -> None:
    sched = Scheduler(BlockManager(64, 4), max_step_tokens=2, max_running=64)
    hog = [Sequence([1, 2], max_tokens=50, client="hog") for _ in range(3)]
    polite = Sequence([3, 4], max_tokens=50, client="polite")
    for s in hog + [polite]:
        sched.add(s)
    first = sched.schedule()
    sched.update(first, [Choice(7, 0.0) for c in first.chunks if c.samples])
    # hog has one running sequence now, polite none: polite is admitted next despite arriving last
    second = sched.schedule()
    assert polite in [c.seq for c in second.chunks]


def test_abort_frees_blocks_and_is_idempotent() -> None:
    sched = Scheduler(BlockManager(8, 4))
    s = Sequence(list(range(1, 10)), max_tokens=5)
    sched.add(s)
    sched.update(sched.schedule(), [Choice(7, 0.0)])
    sched.abort(s)
    sched.abort(s)
    assert s.finish_reason == "cancelled" and sched.blocks.num_free == 8 and not sched.has_work


def test_prompt_longer_than_the_pool_is_refused() -> None:
    sched = Scheduler(BlockManager(2, 4))
    with pytest.raises(ValueError, match="does not fit"):
        sched.add(Sequence(list(range(1, 10)), max_tokens=1))


def test_held_sequences_give_their_running_slots_to_runnable_ones() -> None:
    sched = Scheduler(BlockManager(64, 4), max_step_tokens=64, max_running=2)
    stalled = [Sequence([1, 2, 3], max_tokens=50, client="slow") for _ in range(2)]
    for s in stalled:
        sched.add(s)
    plan = sched.schedule()
    sched.update(plan, [Choice(7, 0.0) for c in plan.chunks if c.samples])
    for s in stalled:
        s.held = True  # their client stopped reading
    other = Sequence([4, 5], max_tokens=3, client="fast")
    sched.add(other)
    steps = run_to_completion_while(sched, lambda: other.status != Status.FINISHED)
    assert other.generated == [7, 7, 7] and len(steps) <= 4  # it ran at once, not after the stalled ones
    # only as many as runnable work needed gave way: the youngest, which keeps nothing; the other
    # still holds its blocks and its slot
    assert stalled[1].status == Status.WAITING and not stalled[1].table and stalled[1].generated == [7]
    assert stalled[0].status == Status.RUNNING and stalled[0].table and stalled[0].generated == [7]
    for s in stalled:
        s.held = False  # the client reads again: they resume and lose nothing
    run_to_completion(sched)
    assert all(s.generated == [7] * 50 and s.finish_reason == "length" for s in stalled)
    assert sched.blocks.num_free == 64


def test_memory_pressure_preempts_held_sequences_first() -> None:
    sched = Scheduler(BlockManager(6, 4), max_step_tokens=64, max_running=4)
    old = Sequence(list(range(1, 9)), max_tokens=20)  # 2 blocks, more as it grows
    held = Sequence(list(range(11, 19)), max_tokens=20)
    sched.add(old)
    sched.add(held)
    plan = sched.schedule()
    sched.update(plan, [Choice(7, 0.0) for c in plan.chunks if c.samples])
    held.held = True
    young = Sequence([21, 22, 23, 24, 25, 26, 27], max_tokens=2)  # needs the blocks held keeps
    sched.add(young)
    run_to_completion_while(sched, lambda: young.status != Status.FINISHED)
    assert young.finish_reason == "length" and old.preemptions == 0 and held.preemptions >= 1


def run_to_completion_while(sched: Scheduler, more, max_steps: int = 1000) -> list[list]:  # type: ignore[no-untyped-def]
    steps = []
    while more() and len(steps) < max_steps:
        plan = sched.schedule()
        steps.append(plan.chunks)
        sched.update(plan, [Choice(7, 0.0) for c in plan.chunks if c.samples])
        sched.blocks.check_integrity([s.table for s in sched.running + list(sched.waiting)])
    return steps


def test_decode_bursts_get_slots_only_when_every_runnable_sequence_decodes_and_none_waits() -> None:
    """A burst of 4 decode steps: each decode gets 3 slots beyond its token (fewer near max_tokens),
    none while a prompt is being read or a sequence waits; a block of 4 counts every position run,
    and a block cut by a stop frees its unused slots with the sequence."""
    sched = Scheduler(BlockManager(32, 4), max_step_tokens=64)
    sched.decode_lookahead = 3
    a = Sequence([1, 2, 3], max_tokens=5)
    b = Sequence([4, 5], max_tokens=20, stop_ids=frozenset({9}))
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # prompts
    assert [c.lookahead for c in first.chunks] == [0, 0]
    sched.update(first, [Choice(7, 0.0), Choice(7, 0.0)])
    late = Sequence(list(range(1, 10)), max_tokens=20)
    sched.add(late)
    mixed = sched.schedule()  # a prompt is read in this step: no burst
    assert [c.lookahead for c in mixed.chunks] == [0, 0, 0]
    sched.update(mixed, [Choice(7, 0.0)] * 3)
    burst = sched.schedule()
    assert [(c.seq, c.length, c.lookahead) for c in burst.chunks] == [(a, 1, 2), (b, 1, 3), (late, 1, 3)]
    assert len(b.table) == sched.blocks.blocks_for(b.n_tokens + 3)
    sched.update(burst, [(Choice(8, 0.0),) * 3, (Choice(8, 0.0),) * 4, (Choice(8, 0.0),) * 2])
    assert a.generated == [7, 7, 8, 8, 8] and a.finish_reason == "length" and a.table == []
    assert b.generated == [7, 7] + [8] * 4 and b.n_computed == b.n_tokens - 1  # every position the burst ran counts
    assert len(b.table) == sched.blocks.blocks_for(b.n_tokens)
    assert late.n_computed == late.n_tokens - 1 and len(late.table) == sched.blocks.blocks_for(late.n_tokens)  # the slots a short block left are freed
    plan = sched.schedule()
    assert [c.lookahead for c in plan.chunks] == [3, 3]
    sched.update(plan, [(Choice(8, 0.0), Choice(9, 0.0), Choice(8, 0.0), Choice(8, 0.0)), (Choice(8, 0.0),) * 4])
    assert b.generated[-2:] == [8, 9] and b.finish_reason == "stop" and b.table == []  # what follows the stop is dropped
    assert late.n_computed == late.n_tokens - 1
    sched.blocks.check_integrity([s.table for s in sched.running + list(sched.waiting)])
