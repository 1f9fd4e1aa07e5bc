"""Automatic prefix caching: full KV blocks named by a chained hash, shared while referenced, kept after use.

A full block of a prompt is named by `block_hashes`: the hash of its parent block's hash and its own token ids
(vLLM's block hashing), so equal hashes mean equal tokens from position 0 to the block's end, and any block
whose hash an instance holds can be mapped into a new sequence, whatever else it holds. The hash is BLAKE2b
(16 bytes): the same on every process and host (the controller, prefill and decode instances compare them),
and not open to crafted collisions, which would hand one request another's KV.

`BlockCache` sits on a `BlockAllocator`: a block is either plain free (the allocator's), held by one sequence
(no hash), cached and referenced (hash, refcount >= 1), or cached and evictable (hash, refcount 0, in an LRU).
Allocation takes plain free blocks first and evicts the least recently released cached blocks only when none
are left, so a referenced block (a running sequence's, or one a pull is reading or writing) is never handed
out. A sequence releases its blocks last to first, so a prompt's tail is evicted before its head and what
stays cached is still a prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from aiollm.errors import KVCacheFull
from aiollm.kv.blocks import BlockAllocator

HASH_BYTES = 16
_ROOT = b"aiollm-prefix-root"


def block_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens` (at most `limit` of them): block i's hash covers
    tokens [0, (i + 1) * block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    ids = np.asarray(tokens[: n * block_size], dtype=np.int64)
    out, parent = [], _ROOT
    for i in range(n):
        parent = hashlib.blake2b(parent + ids[i * block_size : (i + 1) * block_size].tobytes(), digest_size=HASH_BYTES)
        parent = parent.digest()
        out.append(parent)
    return out


class BlockCache:
    """Blocks of one pool: plain free ones (the allocator), and full ones indexed by hash with refcounts and an
    LRU of the unreferenced ones (evictable).

    Counters: `hits` (blocks mapped from the cache by `acquire_cached`), `evictions`."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}  # cached blocks only; a block without a hash has one owner
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0, oldest first
        self.hits = 0
        self.evictions = 0

    @property
    def n_blocks(self) -> int:
        return self.allocator.n_blocks

    @property
    def n_available(self) -> int:
        """Blocks an allocation may take: plain free ones and evictable cached ones."""
        return self.allocator.n_free + len(self._lru)

    @property
    def n_evictable(self) -> int:
        return len(self._lru)

    @property
    def n_cached(self) -> int:
        """Blocks with a hash (referenced or evictable)."""
        return len(self._hash_of)

    def refcount(self, block: int) -> int:
        """References to a cached block (0: evictable); ValueError for a block without a hash."""
        if block not in self._hash_of:
            raise ValueError(f"block {block} is not cached")
        return self._refs[block]

    def is_evictable(self, block: int | None) -> bool:
        """Whether `block` is cached and unreferenced (an allocation may evict it)."""
        return block in self._lru

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._block_of

    def hashes(self) -> set[bytes]:
        return set(self._block_of)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, name cached blocks (the longest cached prefix)."""
        n = 0
        for h in hashes:
            if h not in self._block_of:
                break
            n += 1
        return n

    def lookup(self, hashes: Sequence[bytes]) -> list[int | None]:
        """The cached block of each hash, None where there is none."""
        return [self._block_of.get(h) for h in hashes]

    def acquire_cached(self, hashes: Sequence[bytes]) -> list[int]:
        """Reference the cached blocks of `hashes` (each must be cached) and return them."""
        blocks = [self._block_of[h] for h in hashes]
        for b in blocks:
            self._refs[b] += 1
            self._lru.pop(b, None)
        self.hits += len(blocks)
        return blocks

    def allocate(self, n: int) -> list[int]:
        """n blocks owned by the caller: plain free blocks first, then the least recently released cached ones
        (their hashes forgotten). KVCacheFull, nothing taken, when fewer than n are available."""
        if n > self.n_available:
            raise KVCacheFull(n, self.n_available, self.n_blocks)
        short = n - self.allocator.n_free
        if short > 0:
            victims = [self._lru.popitem(last=False)[0] for _ in range(short)]
            for b in victims:
                del self._block_of[self._hash_of.pop(b)]
                del self._refs[b]
            self.allocator.free(victims)
            self.evictions += short
        return self.allocator.allocate(n)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Name a full block the caller owns by its hash, so others can map it; the caller's reference stays.
        False (nothing changes) when the hash already names another block or the block already has a hash."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._refs[block] = 1
        return True

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, last to first: a cached block whose count reaches 0 becomes the
        most recently used evictable one; a block without a hash goes back to the allocator."""
        plain = []
        for b in reversed(blocks):
            if b in self._hash_of:
                left = self._refs[b] - 1
                if left < 0:
                    raise ValueError(f"blocks: block {b} released more often than referenced")
                self._refs[b] = left
                if left == 0:
                    self._lru[b] = None
            else:
                plain.append(b)
        if plain:
            self.allocator.free(plain)
