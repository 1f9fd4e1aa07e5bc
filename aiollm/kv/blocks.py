"""Block bookkeeping of the paged KV cache: which blocks are free, and which blocks hold each sequence.

Pure Python, no I/O: the scheduler decides, these classes record. A sequence's token t lives in block
`blocks[t // block_size]` at offset `t % block_size`; its slot is `block_id * block_size + offset`.
`BlockTable.block_tables` pads rows with -1 (PAD): the kernel reads only the first ceil(len / block_size)
entries of a row, and -1 makes any misuse of the padding fail the bounds check instead of reading block 0.
"""

import numpy as np

from aiollm.errors import KVCacheFull

PAD = -1


class BlockAllocator:
    """The free blocks of [0, n_blocks), handed out as few contiguous runs as possible. Allocation is
    all-or-nothing.

    Why runs: attention reads a sequence's blocks in table order, and the hardware prefetchers stream a run of
    adjacent blocks but restart at every jump. SmolLM2 fp16 256 x 4096, 2 threads, against the read kernel (Zen 5):
    tables of single scattered blocks read 0.66-0.69 of it, runs of 8 blocks 0.85, of 16 0.92-0.95, whole sequences
    0.95-0.98 (`python -m bench kvalloc`). A LIFO free list hands out contiguous ids only to a fresh pool: after a
    few thousand admissions and frees of mixed lengths its sequences average 1.1 blocks per run. Here a request takes the smallest free run that holds it whole (best
    fit, which leaves the large runs for large requests), else the largest runs until it is covered; either way the
    ids come back ascending. Each call scans the free map (numpy, ~30 us for 20k blocks): allocations are per
    admission or per batch of steps, not per token."""

    def __init__(self, n_blocks: int) -> None:
        if not isinstance(n_blocks, int) or n_blocks < 0:
            raise ValueError(f"n_blocks: expected an int >= 0, got {n_blocks!r}")
        self.n_blocks = n_blocks
        self._free_map = np.ones(n_blocks, np.int8)  # 1 = free
        self._n_free = n_blocks

    @property
    def n_free(self) -> int:
        return self._n_free

    def free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the maximal runs of free blocks, in id order."""
        edges = np.flatnonzero(np.diff(self._free_map, prepend=np.int8(0), append=np.int8(0)))
        return edges[0::2], edges[1::2] - edges[0::2]

    def allocate(self, n: int) -> list[int]:
        """n block ids, ascending; KVCacheFull (nothing allocated) if fewer than n are free."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        if n > self._n_free:
            raise KVCacheFull(n, self._n_free, self.n_blocks)
        if n == 0:
            return []
        starts, lengths = self.free_runs()
        fits = np.flatnonzero(lengths >= n)
        if len(fits):  # best fit: the smallest run that holds all n (argmin: the lowest such run on ties)
            best = fits[np.argmin(lengths[fits])]
            runs = [(int(starts[best]), n)]
        else:  # largest runs first, the last one cut to what is still needed
            runs, left = [], n
            for i in np.argsort(-lengths, kind="stable"):
                take = min(left, int(lengths[i]))
                runs.append((int(starts[i]), take))
                left -= take
                if not left:
                    break
            runs.sort()
        for start, length in runs:
            self._free_map[start : start + length] = 0
        self._n_free -= n
        return [b for start, length in runs for b in range(start, start + length)]

    def free(self, ids: list[int]) -> None:
        """Return blocks; ValueError (nothing freed) on an unknown id or a block that is not allocated."""
        seen = set()
        for i in ids:
            if not 0 <= i < self.n_blocks:
                raise ValueError(f"ids: block {i} is outside [0, {self.n_blocks})")
            if self._free_map[i] or i in seen:
                raise ValueError(f"ids: block {i} is not allocated (double free)")
            seen.add(i)
        self._free_map[list(seen)] = 1
        self._n_free += len(seen)


class BlockTable:
    """The blocks and length of each sequence, growing as tokens are appended.

    A sequence that needs a new block takes `extent` blocks at once (one run from the allocator) and keeps the
    ones it has not reached yet as a reservation. Without it, sequences growing in lockstep (a decode batch, one
    token each per step) would take one block each per round from the same run, so every sequence's table would jump
    at every block: the scattered tables that read ~0.7 of the memory's speed (BlockAllocator). When the allocator
    cannot pad every request, the other sequences' reservations go back to it first, so padding never makes an
    append fail that would fit without it. Every method that allocates checks first and allocates all-or-nothing,
    so a KVCacheFull leaves every sequence's blocks and length unchanged."""

    def __init__(self, allocator: BlockAllocator, block_size: int = 16, extent: int = 16) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
        if not isinstance(extent, int) or extent < 1:
            raise ValueError(f"extent: expected a positive int (blocks taken per growth), got {extent!r}")
        self.allocator = allocator
        self.block_size = block_size
        self.extent = extent
        self._blocks: dict[object, list[int]] = {}  # every block held, the reservation past the length included
        self._lens: dict[object, int] = {}

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._lens

    def __len__(self) -> int:
        return len(self._lens)

    def _n_used(self, seq_id) -> int:
        return -(-self._lens[seq_id] // self.block_size)

    def blocks(self, seq_id) -> list[int]:
        """The blocks holding seq_id's tokens, in order (its reservation left out)."""
        return self._blocks[seq_id][: self._n_used(seq_id)]

    def reserved(self, seq_id) -> int:
        """Blocks seq_id holds past its length."""
        return len(self._blocks[seq_id]) - self._n_used(seq_id)

    def length(self, seq_id) -> int:
        return self._lens[seq_id]

    def blocks_needed(self, seq_id, n_tokens: int) -> int:
        """New blocks that appending n_tokens to seq_id (new or existing) needs beyond those it holds."""
        length = self._lens.get(seq_id, 0)
        have = len(self._blocks.get(seq_id, ()))
        return max(0, -(-(length + n_tokens) // self.block_size) - have)

    def append(self, seq_id, n_tokens: int) -> np.ndarray:
        """Grow seq_id (created if new) by n_tokens; returns their int64 slot_mapping."""
        return self.append_batch([seq_id], [n_tokens])

    def append_batch(self, seq_ids: list, n_tokens: list[int]) -> np.ndarray:
        """Grow several sequences at once (each id at most once); returns the concatenated int64 slot_mapping
        in the order given. KVCacheFull leaves every sequence unchanged."""
        if len(seq_ids) != len(n_tokens):
            raise ValueError(f"n_tokens: expected {len(seq_ids)} counts (one per seq id), got {len(n_tokens)}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: expected each sequence at most once")
        if any(not isinstance(n, (int, np.integer)) or n < 0 for n in n_tokens):
            raise ValueError(f"n_tokens: expected ints >= 0, got {list(n_tokens)}")
        need = [self.blocks_needed(s, int(n)) for s, n in zip(seq_ids, n_tokens)]
        grants = self._grant(seq_ids, n_tokens, need)
        slots, bs = [], self.block_size
        for seq_id, n, new in zip(seq_ids, n_tokens, grants):
            blocks = self._blocks.setdefault(seq_id, [])
            blocks.extend(new)
            start = self._lens.get(seq_id, 0)
            pos = np.arange(start, start + int(n), dtype=np.int64)
            slots.append(np.asarray(blocks, dtype=np.int64)[pos // bs] * bs + pos % bs)
            self._lens[seq_id] = start + int(n)
        return np.concatenate(slots) if slots else np.zeros(0, np.int64)

    def _grant(self, seq_ids: list, n_tokens: list[int], need: list[int]) -> list[list[int]]:
        """New blocks per sequence, each sequence's from one allocation (one run where the pool has it): padded
        to `extent` if the pool allows, else exactly `need` after taking back every block held past what its
        sequence needs once this append is done."""
        alloc = self.allocator
        padded = [max(k, self.extent) if k else 0 for k in need]
        if sum(padded) <= alloc.n_free:
            return [alloc.allocate(k) for k in padded]
        keep = {s: self._n_used(s) for s in self._blocks}
        for s, n in zip(seq_ids, n_tokens):
            keep[s] = -(-(self._lens.get(s, 0) + int(n)) // self.block_size)
        spare = {s: len(self._blocks[s]) - k for s, k in keep.items() if len(self._blocks.get(s, ())) > k}
        if sum(need) > alloc.n_free + sum(spare.values()):
            raise KVCacheFull(sum(need), alloc.n_free + sum(spare.values()), alloc.n_blocks)
        for s in spare:
            alloc.free(self._blocks[s][keep[s] :])
            del self._blocks[s][keep[s] :]
        return [alloc.allocate(k) for k in need]

    def free(self, seq_id) -> None:
        """Forget seq_id and return its blocks (its reservation included) to the allocator."""
        self.allocator.free(self._blocks.pop(seq_id))
        del self._lens[seq_id]

    def block_tables(self, seq_ids: list, max_blocks: int | None = None) -> np.ndarray:
        """int32 [len(seq_ids), max_blocks] (default: the longest row), rows padded with PAD (-1)."""
        rows = [self.blocks(s) for s in seq_ids]
        width = max((len(r) for r in rows), default=0) if max_blocks is None else max_blocks
        table = np.full((len(rows), width), PAD, dtype=np.int32)
        for i, row in enumerate(rows):
            if len(row) > width:
                raise ValueError(f"max_blocks: sequence {seq_ids[i]!r} has {len(row)} blocks, more than {width}")
            table[i, : len(row)] = row
        return table

    def seq_lens(self, seq_ids: list) -> np.ndarray:
        """int32 [len(seq_ids)]: current lengths, including every token appended so far."""
        return np.array([self._lens[s] for s in seq_ids], dtype=np.int32)
