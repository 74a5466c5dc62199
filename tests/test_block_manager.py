"""BlockManager: allocation, reference counts, prefix reuse by hash chain, LRU eviction."""
from __future__ import annotations

import pytest

from ember.daemon.engine.block_manager import BlockManager, prefix_root


def test_allocate_release_and_exhaustion() -> None:
    bm = BlockManager(n_blocks=4, block_size=4)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free == 1
    with pytest.raises(MemoryError):
        bm.allocate(2)
    bm.check_integrity([a])
    bm.release(a)
    assert bm.num_free == 4
    bm.check_integrity()


def test_prefix_blocks_are_shared_and_survive_their_owner() -> None:
    bm = BlockManager(n_blocks=8, block_size=4)
    tokens = list(range(10))  # two full blocks and a partial one
    first = bm.allocate(3)
    bm.register(first, tokens, n_computed=10)
    second = bm.match_prefix(tokens + [99])
    assert second == first[:2]  # full blocks only
    bm.check_integrity([first, second])
    bm.release(first)
    bm.release(second)
    assert bm.num_free == 8  # cached blocks count as free: they can be evicted
    third = bm.match_prefix(tokens)
    assert third == first[:2] and bm.stats.prefix_hits == 4 and bm.stats.prefix_queries == 4
    bm.check_integrity([third])


def test_last_token_is_never_matched() -> None:
    bm = BlockManager(n_blocks=4, block_size=4)
    t = bm.allocate(2)
    bm.register(t, list(range(8)), n_computed=8)
    assert bm.match_prefix(list(range(8))) == t[:1]  # the 8th token must be computed for its logits


def test_different_prefix_same_block_tokens_do_not_match() -> None:
    bm = BlockManager(n_blocks=4, block_size=2)
    t = bm.allocate(2)
    bm.register(t, [1, 2, 3, 4], n_computed=4)
    assert bm.match_prefix([9, 9, 3, 4, 5]) == []  # block [3, 4] follows another prefix


def test_lru_eviction_forgets_the_oldest_prefix() -> None:
    bm = BlockManager(n_blocks=2, block_size=2)
    a = bm.allocate(1)
    bm.register(a, [1, 2], 2)
    bm.release(a)
    b = bm.allocate(1)
    bm.register(b, [3, 4], 2)
    bm.release(b)
    c = bm.allocate(1)  # one free block is left... none: both cached, the older one is evicted
    assert c == a
    assert bm.match_prefix([1, 2, 0]) == [] and bm.match_prefix([3, 4, 0]) == b
    bm.check_integrity([c, b])


def test_prefix_caching_off() -> None:
    bm = BlockManager(n_blocks=4, block_size=2, prefix_caching=False)
    t = bm.allocate(2)
    bm.register(t, [1, 2, 3, 4], 4)
    bm.release(t)
    assert bm.match_prefix([1, 2, 3, 4, 5]) == [] and bm.num_free == 4


def test_incremental_registration_equals_registering_from_scratch() -> None:
    tokens = list(range(100, 137))  # 9 full blocks of 4, and one token more
    whole, stepwise = BlockManager(n_blocks=12, block_size=4), BlockManager(n_blocks=12, block_size=4)
    a, b = whole.allocate(10), stepwise.allocate(10)
    whole.register(a, tokens, n_computed=37)
    done = None
    for n in (3, 4, 9, 9, 22, 36, 37):  # a prompt in chunks, then decode steps
        done = stepwise.register(b, tokens, n_computed=n, done=done)
    assert done is not None and done[0] == 9
    for bm, table in ((whole, a), (stepwise, b)):
        probe = bm.match_prefix(tokens + [1])
        assert probe == table[:9]
        bm.release(probe)
        bm.check_integrity([table])


def test_a_second_copy_of_a_prefix_takes_over_when_the_keeper_is_evicted() -> None:
    bm = BlockManager(n_blocks=8, block_size=4)
    tokens = list(range(8))
    a, b = bm.allocate(2), bm.allocate(2)
    bm.register(a, tokens, 8)
    progress = bm.register(b, tokens, 8)  # computed in the same step: a's blocks keep the prefix
    assert progress[0] == 0  # so b's are tried again later
    bm.release(a)
    taken = bm.allocate(bm.num_free)  # memory runs short: a's cached blocks are evicted, prefix and all
    assert set(a) <= set(taken)
    bm.register(b, tokens, 8, progress)
    bm.release(taken)
    assert bm.match_prefix(tokens + [99]) == b  # b's copy serves the prefix now


def test_salted_chains_share_nothing_across_salts() -> None:
    """Sequences of one salt (one user's) reuse each other's blocks; another salt's never finds them, so
    its first token's time cannot tell what was sent."""
    bm = BlockManager(n_blocks=8, block_size=4)
    tokens = list(range(10))
    alice, bob = prefix_root(b"uid:1000"), prefix_root(b"uid:1001")
    assert len({alice, bob, prefix_root()}) == 3 and prefix_root() == prefix_root(b"")
    first = bm.allocate(3)
    bm.register(first, tokens, n_computed=10, root=alice)
    assert bm.match_prefix(tokens + [99], root=bob) == [] and bm.match_prefix(tokens + [99]) == []
    again = bm.match_prefix(tokens + [99], root=alice)
    assert again == first[:2]
    bm.check_integrity([first, again])
