"""Adaptive speculation (daemon/speculative/spec_switch.py): the switch keeps whichever of speculating
and plain decoding measured faster, probes the other now and then, and tells batch sizes apart; in
the engine, steps of either mode mix without changing a greedy token, the draft catches up on what
it missed (its acceptance stays that of a draft that never missed anything), and a seeded sampled
request always speculates, so that its seed reproduces its tokens."""
from __future__ import annotations

import math
from collections import Counter

import pytest

import ember
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_DRAFT, DEMO_MODEL
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.speculative import spec_switch
from ember.daemon.speculative.spec_switch import SpecSwitch
from ember.kernels.sampling import SamplingParams
from test_engine_core import run

SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):"]


def steps(switch: SpecSwitch, running: int, seconds_per_token: dict[bool, float], n: int, tokens: int = 4) -> None:
    """n decode steps in whatever mode the switch picks, each `tokens` tokens at that mode's cost; the
    first speculative step after plain ones is a catch-up (the engine says so)."""
    last = None
    for _ in range(n):
        mode = switch.speculate(running)
        switch.record(running, mode, seconds_per_token[mode] * tokens, tokens, catch_up=mode and last is False)
        last = mode


def test_slower_speculation_is_turned_off_and_probed_less_and_less() -> None:
    switch = SpecSwitch()
    cost = {True: 2e-3, False: 1e-3}
    assert switch.speculate(1)  # a class starts speculating
    steps(switch, 1, cost, spec_switch.WARM)
    assert not switch.speculate(1)  # then probes plain decoding
    steps(switch, 1, cost, spec_switch.PROBE_STEPS)
    assert not switch.speculate(1) and switch.switches == 1  # plain is faster: kept
    state = switch.classes[1]
    assert state.interval == spec_switch.FIRST_INTERVAL and not state.probing
    steps(switch, 1, cost, spec_switch.FIRST_INTERVAL // 4)
    assert switch.speculate(1)  # a probe of speculation, after `interval` tokens
    steps(switch, 1, cost, spec_switch.PROBE_STEPS + 1)  # its catch-up step, then the measured ones
    assert not switch.speculate(1) and switch.switches == 1  # it lost: plain again, probed less often
    assert state.interval == 2 * 2 * spec_switch.FIRST_INTERVAL  # twice the interval times the ratio of rates
    assert switch.rates(1) == pytest.approx((2e-3, 1e-3))


def test_faster_speculation_is_kept() -> None:
    switch = SpecSwitch()
    cost = {True: 0.5e-3, False: 1e-3}
    steps(switch, 1, cost, spec_switch.WARM + spec_switch.PROBE_STEPS)
    assert switch.speculate(1) and switch.switches == 0
    steps(switch, 1, cost, 200)
    assert switch.speculate(1) and switch.classes[1].interval > spec_switch.FIRST_INTERVAL


def test_speculation_that_yields_unevenly_is_rated_by_its_time_per_token() -> None:
    """Rounds alternate a rejected proposal (1 token, 12 ms) and an accepted one (5 tokens, 18 ms):
    5 ms a token, against plain decoding's 7. The mean of the rounds' own rates (12 and 3.6 ms) is
    7.8 and would turn speculation off."""
    switch = SpecSwitch()
    for i in range(spec_switch.WARM + spec_switch.PROBE_STEPS + 100):
        if switch.speculate(1):
            rejected = i % 2 == 0
            switch.record(1, True, 12e-3 if rejected else 18e-3, 1 if rejected else 5)
        else:
            switch.record(1, False, 4 * 7e-3, 4)
    assert switch.speculate(1) and switch.switches == 0
    assert switch.rates(1)[0] == pytest.approx(5e-3, rel=0.2)


def test_catch_up_steps_are_not_a_rate() -> None:
    """The first speculative step after plain ones also runs the draft over what it missed: a cost of
    switching, left out of speculation's rate."""
    switch = SpecSwitch()
    switch.record(1, True, 1.0, 4, catch_up=True)
    assert switch.rates(1) == (0.0, 0.0)
    switch.record(1, True, 4e-3, 4)
    assert switch.rates(1) == (1e-3, 0.0)


def test_a_probe_of_speculation_waits_for_a_draft_nearly_caught_up() -> None:
    """Catching up costs in proportion to what the draft missed: a probe of speculation starts only
    when little is left to read (the next request's start), and plain steps meanwhile still count."""
    switch = SpecSwitch()
    cost = {True: 2e-3, False: 1e-3}
    steps(switch, 1, cost, spec_switch.WARM + spec_switch.PROBE_STEPS + spec_switch.FIRST_INTERVAL // 4)
    assert switch.speculate(1) and switch.classes[1].probing  # due
    far = spec_switch.CATCH_UP_LIMIT + 1
    assert not switch.speculate(1, behind=far)
    switch.record(1, False, 4 * 0.5e-3, 4)  # a plain step while it waits: its rate counts
    assert switch.rates(1)[1] < 1e-3 and switch.classes[1].probing
    assert switch.speculate(1, behind=spec_switch.CATCH_UP_LIMIT)


def test_batch_sizes_are_measured_apart() -> None:
    """Verification costs more as the batch grows: a batch of 8 keeps its own choice, and a class not
    measured yet starts from the choice of the nearest smaller one that was."""
    switch = SpecSwitch()
    assert switch.speculate(8)  # nothing measured: a class starts speculating
    switch.classes.clear()
    steps(switch, 1, {True: 2e-3, False: 1e-3}, spec_switch.WARM + spec_switch.PROBE_STEPS)
    assert not switch.speculate(1)
    assert not switch.speculate(8)  # speculation lost at 1 sequence: a batch of 8 starts plain...
    faster = {True: 1e-3, False: 2e-3}
    steps(switch, 8, faster, spec_switch.FIRST_INTERVAL - 1, tokens=8)  # (plain: a token a sequence a step)
    assert not switch.speculate(8)  # ...and probes speculation after FIRST_INTERVAL tokens a sequence,
    # not a batch's: its first step catches the draft up (not a rate), then it keeps it, faster here
    steps(switch, 8, faster, 2 + spec_switch.PROBE_STEPS, tokens=8)
    assert switch.speculate(8) and not switch.speculate(1)
    assert not switch.speculate(6)  # 4-7: the nearest smaller measured class is 1's
    assert switch.speculate(16)  # 16-31 starts speculating (the nearest smaller class, 8's, keeps it)...
    steps(switch, 16, {True: 2e-3, False: 1e-3}, spec_switch.WARM)
    assert not switch.speculate(16)  # ...and probes plain decoding after WARM steps, as a first class does


class Alternating(SpecSwitch):
    """Speculates on every other step, whatever it measures."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def speculate(self, running: int, behind: int = 0) -> bool:
        self.calls += 1
        return self.calls % 2 == 0


class Never(SpecSwitch):
    def speculate(self, running: int, behind: int = 0) -> bool:
        return False


@pytest.fixture(scope="module")
def target() -> ember.Model:
    return ember.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def pair() -> ember.Model:
    return ember.load(DEMO_MODEL, draft=DEMO_DRAFT, draft_tokens=4)


def engine_of(model: ember.Model, switch: SpecSwitch, kv_blocks: int = 256, block_size: int = 16,
              **options) -> EngineCore:
    runner = ModelRunner(model.net, kv_blocks, block_size)
    return EngineCore(runner, draft=ModelRunner(model._draft, kv_blocks, block_size), draft_tokens=4,
                      spec_switch=switch, decode_burst=math.inf, max_burst=4, **options)


def test_mixed_modes_give_the_targets_greedy_tokens_and_the_draft_catches_up(target, pair) -> None:
    """Steps alternate: plain decode bursts (the draft reads nothing), then a speculative step whose
    draft first reads the tokens it missed. The tokens are the target's, alone and batched; the
    proposals are accepted as often as a draft that never fell behind gets them accepted (a draft
    that skipped what it missed proposes from a context with holes)."""
    switch = Alternating()
    engine = engine_of(pair, switch, max_running=3)
    seqs = [Sequence(target.tokenize(t), 40) for t in SNIPPETS]
    run(engine, {0: seqs})
    for seq, text in zip(seqs, SNIPPETS, strict=True):
        assert seq.generated == list(target.generate(text, max_tokens=40, ignore_eos=True)), text
    stats = engine.spec_stats
    assert stats.steps > 0 and stats.plain_tokens > 0 and switch.calls > 4
    assert stats.acceptance_rate > 0.5  # the trained pair agrees (77% at k = 4)


def test_preempted_sequences_catch_their_draft_up_from_where_they_run_again(target, pair) -> None:
    """A preempted sequence loses its blocks, the draft's K/V with them: when it runs again in plain
    steps, the draft is behind from where it restarts, and catches up from there (not from where it
    had got to before). Tokens stay the target's; proposals keep being accepted."""
    switch = Alternating()
    engine = engine_of(pair, switch, kv_blocks=12, block_size=4, max_step_tokens=32)  # they preempt each other
    prompts = [pair.tokenize(t) for t in SNIPPETS]
    seqs = [Sequence(p, 24) for p in prompts]
    run(engine, {0: seqs})
    assert engine.scheduler.preemptions > 0
    for seq, text in zip(seqs, SNIPPETS, strict=True):
        assert seq.generated == list(target.generate(text, max_tokens=24, ignore_eos=True)), text
    assert engine.spec_stats.acceptance_rate > 0.5


def test_the_draft_catches_up_from_where_a_preempted_sequence_runs_again(pair) -> None:
    """Preempted, a sequence loses its blocks and the draft's K/V with them: running again in plain
    steps from position 0, its draft is behind from 0, not from where it had read to before."""
    from ember.daemon.engine.scheduler import ScheduledChunk

    engine = engine_of(pair, Never())
    seq = Sequence(pair.tokenize(SNIPPETS[2]), 8)
    seq.draft_pos = 12  # read to 12 before the preemption
    engine._speculating = False
    assert engine._missed(ScheduledChunk(seq, 0, 8)) == [] and seq.draft_pos == 0
    engine._speculating = True
    assert engine._missed(ScheduledChunk(seq, 10, 1)) == seq.tokens[:10]


def test_a_seeded_sampled_request_always_speculates(pair) -> None:
    """Verification draws its random numbers otherwise than plain sampling: a seeded sampled request
    speculates on every step, so its seed gives the same tokens however fast each mode ran; a greedy
    request follows the switch."""
    sampled = SamplingParams(temperature=0.8, top_p=0.95)
    engine = engine_of(pair, Never())
    seeded = Sequence(pair.tokenize(SNIPPETS[0]), 24, sampled, seed=7)
    run(engine, {0: [seeded]})
    assert engine.spec_stats.steps > 0 and engine.spec_stats.plain_tokens == 0
    again = engine_of(pair, Never(), adaptive_draft=False)
    twin = Sequence(pair.tokenize(SNIPPETS[0]), 24, sampled, seed=7)
    run(again, {0: [twin]})
    assert twin.generated == seeded.generated
    greedy = engine_of(pair, Never())
    run(greedy, {0: [Sequence(pair.tokenize(SNIPPETS[0]), 24)]})
    assert greedy.spec_stats.steps == 0 and greedy.spec_stats.plain_tokens >= 23


def test_a_models_engines_share_its_switch(pair) -> None:
    """Model.engine makes an engine per generate call: what one measured, the next one uses."""
    assert pair.engine(64).spec_switch is pair.engine(64).spec_switch is not None
    pair.adaptive_draft = False
    try:
        assert pair.engine(64).spec_switch is None
    finally:
        pair.adaptive_draft = True


@pytest.mark.slow
def test_sampled_tokens_keep_the_targets_law_whichever_mode_runs(target, pair) -> None:
    """Adaptive speculation changes no token's law: 2000 sampled continuations whose steps alternate
    between plain decoding (bursts) and verification follow the plain target's distribution at tokens
    2-4. Their generators are seeded (a reproducible test), and their seeds then hidden from the engine,
    which would otherwise speculate on every step for them."""
    from test_speculative import PARAMS, SEEDS, chi_square_z, later_tokens

    plain = later_tokens(target)[0]
    prompt = pair.tokenize("def main(")
    engine = engine_of(pair, Alternating(), kv_blocks=SEEDS, block_size=4, max_running=256, max_step_tokens=1024,
                       prefix_caching=True)
    seqs = [Sequence(prompt, 4, PARAMS, seed=s + 10_000) for s in range(SEEDS)]
    for seq in seqs:
        seq.seed = None  # the generator stays seeded
    run(engine, {0: seqs})
    assert engine.spec_stats.steps > 0 and engine.spec_stats.plain_tokens > 0  # both modes ran
    for position, i in enumerate((1, 2, 3), start=2):
        mixed = Counter(s.generated[i] for s in seqs)
        assert chi_square_z(plain[i - 1], mixed) < 4.0, f"token {position}: {plain[i - 1].most_common(5)} vs " \
                                                         f"{mixed.most_common(5)}"
