"""SpecSwitch: whether the engine's next decode step speculates with its draft model or decodes plainly
(a compiled decode burst), from what each has measured here: seconds per generated token.

Speculation pays only where a draft pass is cheap beside a target step and its proposals are often
accepted; otherwise it is slower than plain decoding (the demo pair on 2 cores: 0.64x of plain greedy
bursts, issue 45). Nobody can tell which in advance for a pair, a machine, a batch and a text, so the
switch measures both, keeps the faster, and probes the other now and then:

- Per batch-size class (1, 2-3, 4-7, ... running sequences: verification costs more as the batch
  grows, as vLLM's dynamic speculation observes), each mode's seconds per generated token over the
  decode steps that ran in it: exponential moving sums of their seconds and of their tokens, divided.
  Not an average of each step's own seconds per token: speculative steps vary (a rejected round
  yields 1 token, an accepted one 5), and averaging their ratios weighs the slow rounds more than
  their time. On a pair where speculation decodes a token in 5.9 ms and plain bursts in 8.3 ms (the
  demo target deepened to 60 layers, benchmarks/deep_target.py), that bias had the switch decode 350
  of 2,560 greedy tokens and 968 sampled ones plainly.
- A class starts speculating; after WARM measured steps it probes plain decoding, then keeps the
  faster mode. A class whose nearest smaller measured class keeps plain decoding starts plain
  instead, as if decided, and probes speculation only after `interval`: verification costs more as
  the batch grows, so speculation that lost at a smaller batch would lose there too. (Not the other
  way: n-grams that won at 1 sequence lost at 8, 0.90-0.93x, had the class of 8 started speculating
  as if decided.)
- Every `interval` tokens a sequence (a batch's tokens over its sequences: a probe costs PROBE_STEPS
  steps whatever the batch, and a batch of 8 probing every 256 of its tokens probed 8 times as often
  as one sequence; the demo pair decoded 8 greedy streams at 0.93-0.95x of plain decoding) it
  probes the other mode for PROBE_STEPS steps: when the probe wins, it switches (and the interval
  drops back to FIRST_INTERVAL); when it loses, the interval grows by twice the ratio of the two
  rates (a probe twice as slow: four times the interval), up to MAX_INTERVAL, so a mode that keeps
  losing costs less and less.
- The first speculative step after plain steps also catches the draft up on the tokens it missed
  (engine_core.py): its time is a switching cost, not the mode's rate, and is left out of the average.
  That cost grows with the tokens missed (the draft reads them all: on the demo pair, 500 missed
  tokens cost as much as ~100 plain ones), so speculation waits until the draft has at most
  CATCH_UP_LIMIT tokens a sequence to read (in practice the next request's start, whose prompt the
  draft reads with the target's) unless it measured faster: a probe does, and so does a batch-size
  class that has not measured it yet (a batch's last sequences, finishing, fall into smaller classes).

Which mode runs never changes a token's law: plain steps sample exactly, and verification is lossless
(greedy output is the same token for token; tests/test_spec_switch.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

WARM = 4  # measured steps of a mode before its rate counts
PROBE_STEPS = 4  # measured steps a probe of the other mode runs
FIRST_INTERVAL = 256  # generated tokens between probes after a switch
MAX_INTERVAL = 16384
CATCH_UP_LIMIT = 16  # tokens a sequence's draft may have to catch up on for a probe of speculation to start
_ALPHA = 0.3  # weight of a new step in a mode's moving average


@dataclass
class _ModeRate:
    seconds: float = 0.0  # moving sums of the measured steps' seconds and generated tokens
    tokens: float = 0.0
    steps: int = 0  # measured steps

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0

    def add(self, seconds: float, tokens: int) -> None:
        # a second step faster than the first replaces it: a mode's first step in a process may load
        # its compiled code (a first n-gram lookup burst took 180 ms for 32 tokens, the next 32 took
        # 8 ms), which averaged in would hold its rate high for many steps
        replace = self.steps == 0 or (self.steps == 1 and seconds / tokens < self.seconds_per_token)
        if replace:
            self.seconds, self.tokens = seconds, float(tokens)
        else:
            self.seconds = (1 - _ALPHA) * self.seconds + _ALPHA * seconds
            self.tokens = (1 - _ALPHA) * self.tokens + _ALPHA * tokens
        self.steps += 1


@dataclass
class _ClassState:
    """One batch-size class: each mode's rate, the mode kept, and the probe under way."""
    rates: dict[bool, _ModeRate] = field(default_factory=lambda: {True: _ModeRate(), False: _ModeRate()})
    speculate: bool = True  # the mode kept
    decided: bool = False  # by comparing both modes' rates (not yet: the class's first mode)
    probing: bool = False  # the other mode is being probed
    probe_steps: int = 0  # measured steps of the probe so far
    interval: int = FIRST_INTERVAL
    tokens: float = 0.0  # generated since the last decision, per sequence

    def mode(self) -> bool:
        return self.speculate != self.probing


@dataclass
class SpecSwitch:
    """Shared by the engines of one model (Model.engine makes one per generate call): what one
    request measured, the next one uses."""
    classes: dict[int, _ClassState] = field(default_factory=dict)
    switches: int = 0  # times a class changed the mode it keeps

    def speculate(self, running: int, behind: int = 0) -> bool:
        """The mode for the next step of `running` sequences: True to speculate. behind: the tokens
        their draft would have to catch up on first (a probe of speculation waits while they are
        more than CATCH_UP_LIMIT a sequence)."""
        state = self._state(running)
        mode = state.mode()
        if mode and behind > CATCH_UP_LIMIT * max(1, running) and not self._measured_faster(state):
            return False  # a probe, or a class that never measured speculation here: not worth the catch-up
        return mode

    def record(self, running: int, speculated: bool, seconds: float, tokens: int, catch_up: bool = False) -> None:
        """A decode step of `running` sequences ran in mode `speculated`, taking `seconds` for
        `tokens` generated tokens; `catch_up`: it also ran the draft over tokens it had missed."""
        state = self._state(running)
        if tokens <= 0:
            return
        rate = state.rates[speculated]
        if not catch_up:
            rate.add(seconds, tokens)
        if speculated != state.mode():
            return  # a plain step while a probe of speculation waits for the draft to be nearly caught up
        state.tokens += tokens / max(1, running)
        if catch_up:
            return
        if state.probing:
            state.probe_steps += 1
            if state.probe_steps >= PROBE_STEPS:
                self._decide(state)
        elif rate.steps >= WARM and ((state.rates[not speculated].steps == 0 and not state.decided)
                                     or state.tokens >= state.interval):
            state.probing, state.probe_steps = True, 0

    @staticmethod
    def _measured_faster(state: _ClassState) -> bool:
        """The class keeps speculation because it measured it faster than plain decoding."""
        return state.speculate and state.decided and not state.probing

    def _decide(self, state: _ClassState) -> None:
        """The probe is over: keep the faster mode (by the moving averages)."""
        kept, probed = state.rates[state.speculate], state.rates[not state.speculate]
        if probed.seconds_per_token < kept.seconds_per_token:
            state.speculate = not state.speculate
            state.interval = FIRST_INTERVAL
            self.switches += 1
        else:  # the further behind the probe was, the less likely it is to win soon
            behind = probed.seconds_per_token / max(kept.seconds_per_token, 1e-12)
            state.interval = min(int(2 * state.interval * behind), MAX_INTERVAL)
        state.probing, state.probe_steps, state.tokens, state.decided = False, 0, 0, True

    def _state(self, running: int) -> _ClassState:
        key = max(1, running).bit_length()
        state = self.classes.get(key)
        if state is None:
            smaller = [k for k, s in self.classes.items() if k < key and s.decided]
            state = self.classes[key] = _ClassState()
            if smaller and not self.classes[max(smaller)].speculate:  # plain there: plain here, as if decided
                state.speculate, state.decided = False, True
        return state

    def rates(self, running: int) -> tuple[float, float]:
        """(speculative, plain) seconds per generated token measured for `running` sequences (0: not yet)."""
        state = self._state(running)
        return state.rates[True].seconds_per_token, state.rates[False].seconds_per_token
