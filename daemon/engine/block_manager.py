"""BlockManager: who owns which KV cache block, and which full blocks hold a known prefix.

Pure Python: no device memory here (that is kv_cache.py), so it is tested without a model.
A full block is identified by a digest chained over every token before and in it, so equal digests
mean equal prefixes (128-bit blake2b: a collision is not a practical concern). Blocks whose last
owner left but whose prefix is known stay in an LRU list, reusable until memory is needed. A chain may
start from a salted root (prefix_root): sequences of different salts never share a block, so one
client cannot tell from its first token's time what another sent.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = b"ember-prefix-root"


def prefix_root(salt: bytes = b"") -> bytes:
    """The digest chains of sequences with this salt start here (no salt: the shared ROOT)."""
    return hashlib.blake2b(ROOT + b"\0" + salt, digest_size=16).digest() if salt else ROOT


def chain_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return h.digest()


@dataclass
class BlockStats:
    prefix_queries: int = 0  # full prompt blocks looked up
    prefix_hits: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class BlockManager:
    n_blocks: int
    block_size: int
    prefix_caching: bool = True
    stats: BlockStats = field(default_factory=BlockStats)

    def __post_init__(self) -> None:
        self._free: list[int] = list(range(self.n_blocks - 1, -1, -1))  # never used or forgotten
        self._refs = [0] * self.n_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # refs 0, prefix known: LRU order
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    # --- capacity ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= self.num_free

    # --- prefix reuse -----------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], root: bytes = ROOT) -> list[int]:
        """Take (reference) the cached blocks holding the longest known prefix of `tokens`' full blocks
        (chained from `root`: prefix_root of the sequence's salt).

        The last token is never matched: its logits are needed, so it must be computed.
        """
        if not self.prefix_caching:
            return []
        matched, parent = [], root
        for b in range((len(tokens) - 1) // self.block_size):
            parent = chain_digest(parent, tokens[b * self.block_size : (b + 1) * self.block_size])
            self.stats.prefix_queries += 1
            block = self._block_of.get(parent)
            if block is None:
                break
            self.stats.prefix_hits += 1
            self._take(block)
            matched.append(block)
        return matched

    def register(self, table: Sequence[int], tokens: Sequence[int], n_computed: int,
                 done: tuple[int, bytes] | None = None, root: bytes = ROOT) -> tuple[int, bytes]:
        """Record the prefixes of the blocks of `table` that are full of computed tokens (chained from
        `root`, as match_prefix).

        `done` is what an earlier call for the same table returned (blocks already recorded, and the
        last one's digest): only the blocks filled since are hashed, so a sequence costs one digest
        per block over its life, not one per block per step. Returns the progress to pass next time."""
        n_done, parent = done or (0, root)
        full = n_computed // self.block_size
        if not self.prefix_caching or full <= n_done:
            return n_done, parent
        progress: tuple[int, bytes] | None = None
        for b in range(n_done, full):
            before = parent
            parent = chain_digest(parent, tokens[b * self.block_size : (b + 1) * self.block_size])
            block = table[b]
            if self._digest_of.get(block) == parent:
                continue
            if parent not in self._block_of:  # the first block with this prefix stays its keeper
                self._digest_of[block] = parent
                self._block_of[parent] = block
            elif progress is None:  # another block keeps this prefix: retry from here next time, so
                progress = (b, before)  # this copy takes over should the keeper be evicted
        return progress or (full, parent)

    def forget_prefixes(self) -> None:
        """The KV contents are gone (the runner lost its cache): no block keeps a known prefix any more;
        the cached ones are free. Call when no sequence owns blocks with old contents."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._digest_of.clear()
        self._block_of.clear()

    # --- allocation -------------------------------------------------------------------------------
    def allocate(self, n_blocks: int) -> list[int]:
        if not self.can_allocate(n_blocks):
            raise MemoryError(f"KV cache: {n_blocks} blocks wanted, {self.num_free} free")
        return [self._take(self._free.pop() if self._free else self._evict()) for _ in range(n_blocks)]

    def release(self, table: Sequence[int]) -> None:
        for block in table:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def _take(self, block: int) -> int:
        if self._refs[block] == 0:
            self._cached.pop(block, None)
        self._refs[block] += 1
        return block

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        del self._block_of[self._digest_of.pop(block)]
        return block

    # --- checks -----------------------------------------------------------------------------------
    def check_integrity(self, tables: Sequence[Sequence[int]] = ()) -> None:
        """Every block is exactly one of: owned (refs = owners in `tables`), cached, free."""
        owners = [0] * self.n_blocks
        for table in tables:
            for block in table:
                owners[block] += 1
        if owners != self._refs:
            raise RuntimeError("block reference counts disagree with the owners' tables")
        free, cached = set(self._free), set(self._cached)
        for block in range(self.n_blocks):
            states = (self._refs[block] > 0) + (block in free) + (block in cached)
            if states != 1:
                raise RuntimeError(f"block {block} is in {states} states")
        if any(self._block_of[d] != b for b, d in self._digest_of.items()):
            raise RuntimeError("prefix index is inconsistent")
