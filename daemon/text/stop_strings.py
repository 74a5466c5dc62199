"""StopStrings: find stop strings in streamed text, even when they span several tokens.

Text that could still be the start of a stop string is held back until the next delta decides it;
when a stop string appears, the text before it is released and the rest (stop string included) is
dropped, as OpenAI's API does.
"""
from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add a text delta; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        return self._release(self._held + delta, final=False)

    def flush(self) -> str:
        """At the end of generation: no stop string can complete any more; what was held back is
        released up to the first stop string in it (then `stopped`), or whole."""
        text, self._held = self._held, ""
        return "" if self.stopped else self._release(text, final=True)

    def _release(self, text: str, final: bool) -> str:
        """The text cut at the stop string that starts first, as in the whole text: a stop found here
        waits while a longer one that starts before it could still complete ("\naa" over "a" in
        "\na", one delta before the second "a")."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        first = min(hits, default=len(text))
        pending = len(text) if final else len(text) - self._partial_suffix(text)  # where a partial one starts
        if hits and first <= pending:
            self.stopped, self._held = True, ""
            return text[:first]
        self._held = text[pending:]
        return text[:pending]

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
