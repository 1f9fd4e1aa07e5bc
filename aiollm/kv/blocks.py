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
    """A free list of block ids in [0, n_blocks). Allocation is all-or-nothing."""

    def __init__(self, n_blocks: int) -> None:
        if not isinstance(n_blocks, int) or n_blocks < 0:
            raise ValueError(f"n_blocks: expected an int >= 0, got {n_blocks!r}")
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used = bytearray(n_blocks)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n block ids; KVCacheFull (nothing allocated) if fewer than n are free."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        if n > len(self._free):
            raise KVCacheFull(n, len(self._free), self.n_blocks)
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._used[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Return blocks; ValueError (nothing freed) on an unknown id or a block that is not allocated."""
        seen = set()
        for i in ids:
            if not 0 <= i < self.n_blocks:
                raise ValueError(f"ids: block {i} is outside [0, {self.n_blocks})")
            if not self._used[i] or i in seen:
                raise ValueError(f"ids: block {i} is not allocated (double free)")
            seen.add(i)
        for i in ids:
            self._used[i] = 0
        # pushed in reverse, so a later allocation pops them in the order given: a freed sequence's blocks come
        # back in its (ascending) table order, the order attention reads them fastest
        self._free.extend(reversed(ids))


class BlockTable:
    """The blocks and length of each sequence, growing as tokens are appended.

    Every method that allocates checks first and allocates all-or-nothing, so a KVCacheFull leaves the
    table unchanged."""

    def __init__(self, allocator: BlockAllocator, block_size: int = 16) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
        self.allocator = allocator
        self.block_size = block_size
        self._blocks: dict[object, list[int]] = {}
        self._lens: dict[object, int] = {}

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._lens

    def __len__(self) -> int:
        return len(self._lens)

    def blocks(self, seq_id) -> list[int]:
        return list(self._blocks[seq_id])

    def length(self, seq_id) -> int:
        return self._lens[seq_id]

    def blocks_needed(self, seq_id, n_tokens: int) -> int:
        """New blocks that appending n_tokens to seq_id (new or existing) would take."""
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
        new = self.allocator.allocate(sum(need))
        slots, at, bs = [], 0, self.block_size
        for seq_id, n, k in zip(seq_ids, n_tokens, need):
            blocks = self._blocks.setdefault(seq_id, [])
            blocks.extend(new[at:at + k])
            at += k
            start = self._lens.get(seq_id, 0)
            pos = np.arange(start, start + int(n), dtype=np.int64)
            slots.append(np.asarray(blocks, dtype=np.int64)[pos // bs] * bs + pos % bs)
            self._lens[seq_id] = start + int(n)
        return np.concatenate(slots) if slots else np.zeros(0, np.int64)

    def free(self, seq_id) -> None:
        """Forget seq_id and return its blocks to the allocator."""
        self.allocator.free(self._blocks.pop(seq_id))
        del self._lens[seq_id]

    def block_tables(self, seq_ids: list, max_blocks: int | None = None) -> np.ndarray:
        """int32 [len(seq_ids), max_blocks] (default: the longest row), rows padded with PAD (-1)."""
        rows = [self._blocks[s] for s in seq_ids]
        width = max((len(r) for r in rows), default=0) if max_blocks is None else max_blocks
        table = np.full((len(rows), width), PAD, dtype=np.int32)
        for i, row in enumerate(rows):
            if len(row) > width:
                raise ValueError(f"max_blocks: sequence {seq_ids[i]!r} has {len(row)} blocks, more than {width}")
            table[i, :len(row)] = row
        return table

    def seq_lens(self, seq_ids: list) -> np.ndarray:
        """int32 [len(seq_ids)]: current lengths, including every token appended so far."""
        return np.array([self._lens[s] for s in seq_ids], dtype=np.int32)
