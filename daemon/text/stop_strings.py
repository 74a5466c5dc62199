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
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: whatever was held back is not a stop string after all."""
        text, self._held = self._held, ""
        return "" if self.stopped else text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
