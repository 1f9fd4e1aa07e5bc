"""How an allocator lays sequences out in a KV pool, and the measure of it.

The attention kernel streams a sequence's blocks in table order; the hardware prefetchers follow a run of
adjacent blocks but restart at every jump, so blocks per run is what the layout costs the R-part. The tables
here are those a pool really hands out: after hours of admissions and frees (`churned_tables`), or grown one
block per sequence per step (`lockstep_tables`); `LifoFreeList` is the simplest allocator, the baseline
`BlockAllocator`'s best-fit runs are measured against (`python -m bench kvalloc`).
"""

import numpy as np

from aiollm.kv.blocks import BlockAllocator, BlockTable

# blocks per churn sequence: [low, high)
CHURN_SIZES = (4, 129)


class LifoFreeList:
    """The peer: a LIFO free list (the simplest allocator), each request's ids sorted per sequence."""

    def __init__(self, n_blocks: int) -> None:
        self._free = list(range(n_blocks - 1, -1, -1))

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        return sorted(self._free.pop() for _ in range(n))

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


def churned_tables(alloc, batch: int, blocks: int, rounds: int) -> np.ndarray:
    """The batch's tables after `rounds` of admissions (to 95 % full) and random frees; seeded, so every
    allocator sees the same requests (they depend only on the free count, which all allocators keep alike)."""
    rng = np.random.default_rng(0)
    live, n_total = {}, alloc.n_free
    for step in range(rounds):
        while True:
            n = int(rng.integers(*CHURN_SIZES))
            if alloc.n_free - n < n_total // 20:
                break
            live[(step, len(live))] = alloc.allocate(n)
        for key in [k for k in live if rng.random() < 0.04]:
            alloc.free(live.pop(key))
    keys = list(live)
    for i in rng.permutation(len(keys)):  # make room for the batch, freeing at random
        if alloc.n_free >= batch * blocks:
            break
        alloc.free(live.pop(keys[i]))
    return np.array([alloc.allocate(blocks) for _ in range(batch)], np.int32)


def lockstep_tables(n_blocks: int, batch: int, blocks: int, extent: int, block_size: int = 16) -> np.ndarray:
    """The batch's tables when it grows one block per sequence per round through BlockTable."""
    grow = BlockTable(BlockAllocator(n_blocks), block_size, extent=extent)
    seqs = list(range(batch))
    for _ in range(blocks):
        grow.append_batch(seqs, [block_size] * batch)
    return grow.block_tables(seqs)


def blocks_per_run(tables: np.ndarray) -> np.ndarray:
    """Per sequence: its blocks over its maximal runs of consecutive ids."""
    jumps = np.count_nonzero(np.diff(tables, axis=1) != 1, axis=1)
    return tables.shape[1] / (1 + jumps)
