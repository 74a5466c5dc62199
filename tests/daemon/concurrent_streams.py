"""Streams run together through a daemon, for tests that compare them with solo in-process runs."""
from __future__ import annotations

import asyncio
from typing import Any

from ember.client import AsyncClient


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
