"""Where a prompt's prefix is cached: the controller's approximate index of each prefill instance's prefix cache.

The controller does not ask the instances what they cache (that would be a set of block hashes per instance, sent
again and again); it remembers the full-block hashes (aiollm.kv.prefix_cache.block_hashes) of the prompts it sent
to each instance, most recently sent last, up to that instance's KV capacity in blocks, and forgets the oldest
beyond it: the instance's cache evicts least recently used blocks first, so this is what it most likely still
holds. An instance lost or taken back starts empty. A wrong guess costs only compute: the instance maps what it
really holds and computes the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Per instance, the block hashes of the prompts sent there (most recent last, at most `capacity` blocks)."""

    def __init__(self, default_capacity: int = 1024) -> None:
        if default_capacity < 1:
            raise ValueError(f"default_capacity: expected >= 1, got {default_capacity}")
        self.default_capacity = default_capacity
        self._hashes: dict[str, OrderedDict[bytes, None]] = {}
        self._capacity: dict[str, int] = {}

    def set_capacity(self, name: str, blocks: int) -> None:
        """The instance's KV capacity in blocks (what its cache can hold at most)."""
        if blocks >= 1:
            self._capacity[name] = blocks
            self._trim(name)

    def record(self, name: str, hashes: Sequence[bytes]) -> None:
        """A prompt with these full-block hashes was sent to `name`: they are its most recent."""
        held = self._hashes.setdefault(name, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        self._trim(name)

    def match(self, name: str, hashes: Sequence[bytes]) -> int:
        """Blocks of the longest prefix of `hashes` that `name` likely holds."""
        held = self._hashes.get(name)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def forget(self, name: str) -> None:
        """`name` lost its cache (it died, was restarted or drained)."""
        self._hashes.pop(name, None)

    def __len__(self) -> int:
        return sum(len(h) for h in self._hashes.values())

    def _trim(self, name: str) -> None:
        held = self._hashes.get(name)
        capacity = self._capacity.get(name, self.default_capacity)
        while held and len(held) > capacity:
            held.popitem(last=False)
