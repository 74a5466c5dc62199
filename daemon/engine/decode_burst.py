"""Decode bursts: how many decode steps the engine runs in one go (EngineCore's decode_burst).

A decode step's host work (scheduling, the step's arrays, sampling bookkeeping, accounting) is paid
once per engine step. While every running sequence decodes and nobody waits, the engine may run
several decode steps in a row inside one engine step (executor/burst.py), each step's sampled tokens
the next one's input: the tokens are those of single steps, they only reach a client a few at a
time. This module sizes a burst by time, so that a stream's tokens never arrive more than
`seconds` apart for the burst's sake: on the 12 MB demo model (~1.2 ms a token on the 2-core VM,
~0.2 ms of it that host work) a burst is the most, MAX_BURST; a 100 MB model's ~10 ms steps stay
single.
"""
from __future__ import annotations

# seconds of decode one burst may take: 16 ms (60 chunks a second at most, far below what a reader
# sees) rather than 8, since each burst's tokens wake the daemon's front and its client, whose
# threads then take cores from the kernels (demo model, the daemon streaming one request, alternated
# 7 times: 1560 tok/s at 8 ms, 1694 at 16; in process 1841 and 1788, the same within noise)
DECODE_BURST = 0.016
MAX_BURST = 32  # decode steps in one burst at most


class BurstClock:
    def __init__(self, seconds: float, max_steps: int = MAX_BURST) -> None:
        """seconds: how long a burst may take (0: every step decodes one token)."""
        if max_steps < 1 or not seconds >= 0:
            raise ValueError(f"decode bursts need max_steps >= 1 and seconds >= 0, got {max_steps} and {seconds}")
        self.seconds = seconds
        self.max_steps = max_steps
        self._step_s: float | None = None  # a decode step's seconds, averaged over the last ones

    def size(self) -> int:
        """Decode steps the next burst may run: what fits in `seconds` at the recent rate (one until
        a decode step was timed)."""
        if not self.seconds or self._step_s is None:
            return 1
        return max(1, int(min(self.max_steps, self.seconds / max(self._step_s, 1e-9))))

    def timed(self, seconds: float, steps: int) -> None:
        """A burst of `steps` decode steps (or a single one) took `seconds`. A faster step is believed
        at once, a slower one averaged in: one stall (the first burst loads its compiled code, ~0.1 s)
        would otherwise keep the bursts of a clock that outlives its engine (Model.engine's) at one
        step for dozens of steps."""
        step_s = seconds / steps
        if self._step_s is None or step_s < self._step_s:
            self._step_s = step_s
        else:
            self._step_s = 0.75 * self._step_s + 0.25 * step_s
