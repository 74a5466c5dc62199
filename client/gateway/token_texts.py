"""Token ids -> their text, for OpenAI's logprobs (which name each token and its alternatives by text).

The daemon's Tokens frames carry ids and the text of the whole frame; logprobs need each token's own text,
so the gateway asks the daemon (Detokenize of one id) once per id and model and keeps the answer. The
cache holds at most the vocabulary of each model the daemon served a request for (ids come from the
daemon, never from a client). A token that is part of a UTF-8 character reads as U+FFFD, as in
llama.cpp's server; its `bytes` are those of that text.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

Detokenize = Callable[[list[int], str], Awaitable[str]]

# Detokenizes in flight at once: under the daemon's tokenizer requests per connection (16 by default),
# which the small calls of metrics and health share
CONCURRENCY = 8


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
                cache[token] = await self._detokenize([token], model)


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))
