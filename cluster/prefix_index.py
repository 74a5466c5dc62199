"""Which replica has seen which prompt prefixes: the memory behind prefix-aware routing.

A prompt's text is cut into blocks of `block_chars` characters and each block is named by a hash of
everything up to its end (a chain, as the daemon's prefix cache names its KV blocks), so a block's
name stands for its whole prefix. A replica's entry remembers the names of the blocks of the prompts
routed to it, least recently used forgotten first beyond `max_blocks`: the daemon's own cache evicts
too, so an old prefix is a guess either way. The match of a prompt on a replica is how many of its
leading blocks that replica remembers.

Text, not tokens: the router runs before tokenization, in the ingress, and a tokenizer's blocks and
these agree on what "the same prefix" means for any prompt longer than a block or two. SGLang's router
matches on text too, for the same reason.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict


class PrefixIndex:
    def __init__(self, block_chars: int = 64, max_blocks: int = 1 << 16) -> None:
        if block_chars < 1 or max_blocks < 1:
            raise ValueError(f"block_chars and max_blocks must be >= 1, got {block_chars} and {max_blocks}")
        self.block_chars, self.max_blocks = block_chars, max_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}  # replica -> its blocks' names, oldest first

    def blocks(self, text: str) -> list[bytes]:
        """The names of `text`'s whole blocks (a last partial block is no prefix anyone shares yet)."""
        names, chain = [], b""
        for end in range(self.block_chars, len(text) + 1, self.block_chars):
            chain = hashlib.blake2b(chain + text[end - self.block_chars:end].encode("utf-8", "surrogatepass"),
                                    digest_size=16).digest()
            names.append(chain)
        return names

    def matches(self, blocks: list[bytes], replicas: list[str]) -> dict[str, int]:
        """For each of `replicas`, how many of `blocks`' leading blocks it has seen."""
        out = {}
        for r in replicas:
            seen, n = self._blocks.get(r), 0
            if seen is not None:
                while n < len(blocks) and blocks[n] in seen:
                    n += 1
            out[r] = n
        return out

    def insert(self, replica: str, blocks: list[bytes]) -> None:
        """`blocks` were routed to `replica`: remembered there, as its most recent."""
        seen = self._blocks.setdefault(replica, OrderedDict())
        for b in blocks:
            seen[b] = None
            seen.move_to_end(b)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)

    def remove(self, replica: str) -> None:
        """The replica is gone: what it held is gone with it."""
        self._blocks.pop(replica, None)

    def keep_only(self, replicas: set[str]) -> None:
        for r in set(self._blocks) - replicas:
            del self._blocks[r]

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))
