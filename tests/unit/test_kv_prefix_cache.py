"""The prefix cache's blocks: the chained hash, refcounts, LRU eviction order, and (a hypothesis state machine)
that eviction never hands out a block some sequence still references."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aiollm.errors import KVCacheFull
from aiollm.kv.blocks import BlockAllocator
from aiollm.kv.prefix_cache import HASH_BYTES, BlockCache, block_hashes


def test_the_hash_of_a_block_covers_every_token_before_it():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2 and all(len(h) == HASH_BYTES for h in a)  # the partial third block has none
    assert block_hashes(list(range(32)) + [7, 7], 16) == a  # the tail past the last full block is not hashed
    changed_first = block_hashes([99] + list(range(1, 40)), 16)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # block 1's hash chains block 0's
    changed_second = block_hashes(list(range(16)) + [99] + list(range(17, 40)), 16)
    assert changed_second[0] == a[0] and changed_second[1] != a[1]
    assert block_hashes(list(range(40)), 16, limit=1) == a[:1]
    assert block_hashes(list(range(40)), 8)[1] != a[0]  # the block size is part of what a hash names


def test_same_tokens_in_other_blocks_hash_differently():
    tokens = [5] * 32
    first, second = block_hashes(tokens, 16)
    assert first != second


def _cache(n: int) -> BlockCache:
    return BlockCache(BlockAllocator(n))


def test_a_released_block_stays_cached_until_its_blocks_are_needed():
    cache = _cache(4)
    h = block_hashes(list(range(64)), 16)
    blocks = cache.allocate(4)
    for b, hh in zip(blocks, h):
        assert cache.register(b, hh)
    assert cache.n_available == 0
    cache.release(blocks)
    assert cache.n_available == 4 and cache.n_evictable == 4 and cache.match(h) == 4
    assert cache.acquire_cached(h[:2]) == blocks[:2]
    assert cache.refcount(blocks[0]) == 1 and cache.n_evictable == 2
    cache.allocate(1)  # no plain free block: evicts one, the tail of the released sequence first
    assert cache.match(h) == 3 and cache.evictions == 1
    cache.allocate(1)
    assert cache.match(h) == 2
    with pytest.raises(KVCacheFull):
        cache.allocate(1)  # the two left are referenced


def test_plain_free_blocks_go_before_any_cached_one():
    cache = _cache(6)
    h = block_hashes(list(range(32)), 16)
    cached = cache.allocate(2)
    for b, hh in zip(cached, h):
        cache.register(b, hh)
    cache.release(cached)
    got = cache.allocate(4)
    assert not set(got) & set(cached) and cache.match(h) == 2 and cache.evictions == 0


def test_eviction_takes_the_least_recently_released_first():
    cache = _cache(3)
    h_a, h_b, h_c = (block_hashes([i] * 16, 16)[0] for i in (1, 2, 3))
    a, b, c = cache.allocate(3)
    for block, hh in ((a, h_a), (b, h_b), (c, h_c)):
        cache.register(block, hh)
    cache.release([b])
    cache.release([a])
    cache.release([c])
    cache.acquire_cached([h_b])  # used again, then released: now the most recent
    cache.release([b])
    assert cache.allocate(1) == [a]
    assert cache.allocate(1) == [c]
    assert cache.allocate(1) == [b]


def test_a_shared_block_is_evictable_only_after_its_last_reference():
    cache = _cache(2)
    h = block_hashes(list(range(16)), 16)
    (block,) = cache.allocate(1)
    cache.register(block, h[0])
    cache.acquire_cached(h)  # a second sequence maps it
    cache.release([block])
    assert cache.refcount(block) == 1 and cache.n_evictable == 0
    cache.allocate(1)
    with pytest.raises(KVCacheFull):
        cache.allocate(1)
    cache.release([block])
    assert cache.n_evictable == 1
    with pytest.raises(ValueError, match="released more often"):
        cache.release([block])


def test_a_hash_names_one_block():
    cache = _cache(2)
    h = block_hashes(list(range(16)), 16)[0]
    a, b = cache.allocate(2)
    assert cache.register(a, h)
    assert not cache.register(b, h)  # the same prefix computed twice: the second copy stays plain
    cache.release([b])
    assert cache.allocator.n_free == 1 and cache.lookup([h]) == [a]


class BlockCacheMachine(RuleBasedStateMachine):
    """Sequences map cached prefixes, allocate, register and release in any order; what each one holds is never
    handed to another, and every block is accounted for exactly once."""

    N = 12

    def __init__(self):
        super().__init__()
        self.cache = _cache(self.N)
        self.held: dict[int, list[int]] = {}  # sequence -> blocks it references
        self.next_id = 0

    @rule(prefix=st.integers(0, 3), extra=st.integers(0, 4), tokens=st.integers(0, 2))
    def admit(self, prefix, extra, tokens):
        hashes = block_hashes([tokens] * (16 * prefix), 16)
        hit = self.cache.match(hashes)
        revived = sum(self.cache.is_evictable(b) for b in self.cache.lookup(hashes[:hit]))
        if extra + (prefix - hit) > self.cache.n_available - revived:
            return
        blocks = self.cache.acquire_cached(hashes[:hit])
        new = self.cache.allocate(extra + prefix - hit)
        others = {b for bs in self.held.values() for b in bs}
        assert not set(new) & others  # never a block someone references
        blocks += new
        for b, hh in zip(blocks[:prefix], hashes):
            self.cache.register(b, hh)
        self.held[self.next_id] = blocks
        self.next_id += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(sorted(self.held)))
        self.cache.release(self.held.pop(seq))

    @invariant()
    def every_block_is_somewhere_once(self):
        referenced = {b for bs in self.held.values() for b in bs}
        for b in referenced:
            if b in self.cache._hash_of:
                holders = sum(bs.count(b) for bs in self.held.values())
                assert self.cache.refcount(b) == holders
        assert self.cache.allocator.n_free + self.cache.n_evictable + len(referenced) == self.N


TestBlockCacheMachine = BlockCacheMachine.TestCase
TestBlockCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
