"""Token ids -> their text, for OpenAI's logprobs (which name each token and its alternatives by text).

The daemon's Tokens frames carry ids and the text of the whole frame; logprobs need each token's own text,
so the gateway asks the daemon (Detokenize of one id) once per id and model and keeps the answer. The
cache holds at most the vocabulary of each model the daemon served a request for (ids come from the
daemon, never from a client). A token that is part of a UTF-8 character reads as U+FFFD, as in
llama.cpp's server; its `bytes` are those of that text. A daemon whose tokenizer helpers are all busy
answers Busy ("retry later"): the gateway retries for a while (a decode burst brings several tokens
and their alternatives in one frame, so a chunk may need more texts than a small daemon takes at
once) before the request fails.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from ember.client.errors import Busy

Detokenize = Callable[[list[int], str], Awaitable[str]]

# Detokenizes in flight at once: under the daemon's tokenizer requests per connection (16 by default),
# which the small calls of metrics and health share
CONCURRENCY = 8
BUSY_RETRY = 0.005  # seconds before the first retry of a Busy answer, doubled each time up to BUSY_RETRY_MAX
BUSY_RETRY_MAX = 0.1
BUSY_PATIENCE = 10.0  # seconds of Busy answers for one id before its request fails


class TokenTexts:
    def __init__(self, detokenize: Detokenize, concurrency: int = CONCURRENCY) -> None:
        self._detokenize = detokenize
        self._cache: dict[str, dict[int, str]] = {}
        self._gate = asyncio.Semaphore(concurrency)

    async def texts(self, model: str, ids: Iterable[int]) -> dict[int, str]:
        """The texts of `ids` (and of every id seen before for `model`)."""
        cache = self._cache.get(model)
        if cache is None:
            cache = self._cache[model] = {}
        missing = {i for i in ids if i not in cache}
        if missing:
            await asyncio.gather(*(self._fetch(model, i, cache) for i in missing))
        return cache

    async def _fetch(self, model: str, token: int, cache: dict[int, str]) -> None:
        async with self._gate:
            if token not in cache:
                cache[token] = await self._patiently(model, token)

    async def _patiently(self, model: str, token: int) -> str:
        loop = asyncio.get_running_loop()
        give_up, pause = loop.time() + BUSY_PATIENCE, BUSY_RETRY
        while True:
            try:
                return await self._detokenize([token], model)
            except Busy:
                if loop.time() + pause > give_up:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, BUSY_RETRY_MAX)


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))
