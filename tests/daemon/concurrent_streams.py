"""Streams run together through a daemon, for tests that compare them with solo in-process runs or time
them beside an attack."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from ember.client import AsyncClient, Client


async def streams_after_a_cancel(socket: str, jobs: list[tuple[str, dict[str, Any]]], cancelled_tokens: int
                                 ) -> list[list[int]]:
    """The token ids of `jobs` (prompt, generate options) streamed at once, after a stream asking for
    `cancelled_tokens` was cancelled at its first chunk (its slot, blocks and state freed for them)."""
    async with AsyncClient(socket) as client:
        async def read(prompt: str, options: dict[str, Any]) -> list[int]:
            return [t async for chunk in client.generate(prompt, **options) for t in chunk.token_ids]

        first = client.generate("import os\n", max_tokens=cancelled_tokens, ignore_eos=True)
        async for _ in first:
            break
        first.cancel()
        return list(await asyncio.gather(*[read(p, o) for p, o in jobs]))


class PacedStream:
    """A greedy stream in a thread beside an attack, noting the time between its chunks."""

    def __init__(self, socket: Path, max_tokens: int) -> None:
        self.gaps: list[float] = []
        self._thread = threading.Thread(target=self._run, args=(socket, max_tokens))
        self._thread.start()
        while not self.gaps and self._thread.is_alive():  # its first chunk: the attack may begin
            time.sleep(0.01)

    def _run(self, socket: Path, max_tokens: int) -> None:
        with Client(socket) as client:
            last = time.perf_counter()
            for _ in client.generate("def fibonacci(n):", max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
                now = time.perf_counter()
                self.gaps.append(now - last)
                last = now

    def finish(self) -> float:
        """Wait for its end -> the largest gap after its first chunk (asserting it had more than 10)."""
        self._thread.join(300)
        assert len(self.gaps) > 10, self.gaps
        return max(self.gaps[1:])
