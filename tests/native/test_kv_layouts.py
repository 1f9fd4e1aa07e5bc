"""The table layouts `python -m bench kvalloc` measures: what each allocator hands a batch after churn."""

import numpy as np

from aiollm.kv.blocks import BlockAllocator
from aiollm.kv.layouts import LifoFreeList, blocks_per_run, churned_tables, lockstep_tables


def test_blocks_per_run_counts_jumps():
    tables = np.array([[4, 5, 6, 7], [0, 2, 3, 9], [8, 7, 6, 5]], np.int32)
    assert blocks_per_run(tables).tolist() == [4.0, 4 / 3, 1.0]


def test_churned_tables_are_valid_and_best_fit_keeps_longer_runs_than_lifo():
    best = churned_tables(BlockAllocator(4096), 16, 32, rounds=3000)
    lifo = churned_tables(LifoFreeList(4096), 16, 32, rounds=3000)
    for t in (best, lifo):
        assert t.shape == (16, 32) and len(np.unique(t)) == t.size and 0 <= t.min() and t.max() < 4096
        assert (np.diff(t, axis=1) > 0).all()  # each sequence's blocks ascending
    # seeded: best fit 23.1 blocks per run of 32, the LIFO list 11.1
    assert blocks_per_run(best).mean() >= 16 and blocks_per_run(best).mean() > 1.5 * blocks_per_run(lifo).mean()


def test_lockstep_growth_runs_are_the_extent():
    assert (blocks_per_run(lockstep_tables(512, 8, 32, 16)) == 16).all()
    assert (blocks_per_run(lockstep_tables(512, 8, 32, 1)) == 1).all()
