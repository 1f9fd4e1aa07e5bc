"""Block allocation, block tables, KVConfig validation and raw block export/import."""

import numpy as np
import pytest

from aiollm.errors import AiollmError, KVCacheFull
from aiollm.kv.blocks import PAD, BlockAllocator, BlockTable
from aiollm.kv.pool import DEFAULT_KV_DTYPE, KVConfig, KVPool
from tests.native.conftest import reference


def test_allocator_hands_out_and_takes_back():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert sorted(a) == [0, 1, 2] and alloc.n_free == 1
    with pytest.raises(KVCacheFull, match="asked for 2 blocks, 1 free of 4") as info:
        alloc.allocate(2)
    assert isinstance(info.value, AiollmError) and info.value.requested == 2
    assert alloc.n_free == 1  # all or nothing
    alloc.free(a[:2])
    assert alloc.n_free == 3
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[2], a[2]])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a[0]])
    with pytest.raises(ValueError, match="outside"):
        alloc.free([4])
    assert alloc.n_free == 3


def runs_of(ids) -> int:
    """Maximal runs of consecutive ids in a block list."""
    return 1 + int(np.count_nonzero(np.diff(ids) != 1)) if len(ids) else 0


def test_allocator_takes_the_smallest_run_that_fits():
    alloc = BlockAllocator(10)
    a, b, c = alloc.allocate(3), alloc.allocate(2), alloc.allocate(4)
    assert (a, b, c) == ([0, 1, 2], [3, 4], [5, 6, 7, 8])
    alloc.free(a)
    alloc.free(c)  # free runs: [0, 3) and [5, 10)
    assert [x.tolist() for x in alloc.free_runs()] == [[0, 5], [3, 5]]
    assert alloc.allocate(3) == [0, 1, 2]  # the 3-run, not the head of the 5-run
    assert alloc.allocate(5) == [5, 6, 7, 8, 9]
    assert alloc.n_free == 0 and alloc.allocate(0) == []


def test_allocator_covers_a_request_no_run_holds_with_the_largest_runs_ascending():
    alloc = BlockAllocator(12)
    held = alloc.allocate(12)
    alloc.free([1, 2, 5, 6, 7, 10])  # free runs of 2, 3 and 1
    got = alloc.allocate(5)
    assert got == [1, 2, 5, 6, 7] and alloc.n_free == 1
    alloc.free(got + [b for b in held if b not in got + [10]])
    assert alloc.n_free == 12 and [x.tolist() for x in alloc.free_runs()] == [[0], [12]]


def test_allocator_keeps_sequences_in_long_runs_under_churn():
    # an R-worker's life: sequences of 4-128 blocks admitted while 5 % stays free, a random few freed each round;
    # a LIFO free list gives 1.1 blocks per run here (every table scattered), best fit keeps whole runs
    rng = np.random.default_rng(0)
    alloc, live, ratios, single = BlockAllocator(4000), {}, [], 0
    for step in range(600):
        while True:
            n = int(rng.integers(4, 129))
            if alloc.n_free - n < 200:
                break
            fits = alloc.free_runs()[1].max() >= n
            ids = alloc.allocate(n)
            assert ids == sorted(ids) and len(set(ids)) == n
            assert not fits or runs_of(ids) == 1  # whenever one free run holds the request, it gets one run
            single += fits
            live[(step, len(live))] = ids
            if step >= 100:
                ratios.append(n / runs_of(ids))
        for key in [k for k in live if rng.random() < 0.04]:
            alloc.free(live.pop(key))
    assert sum(map(len, live.values())) + alloc.n_free == 4000
    assert single > 100 and np.mean(ratios) > 16


def test_block_table_grows_sequences_in_lockstep_in_runs_of_extent():
    # a decode batch: 8 sequences, one token each per step; each takes its blocks 4 at a time, in one run
    table = BlockTable(BlockAllocator(64), block_size=4, extent=4)
    seqs = list(range(8))
    for _ in range(32):
        table.append_batch(seqs, [1] * 8)
    for s in seqs:
        blocks = table.blocks(s)
        assert len(blocks) == 8 and runs_of(blocks) <= 2 and table.reserved(s) == 0
    with pytest.raises(ValueError, match="extent"):
        BlockTable(BlockAllocator(4), extent=0)


def test_block_table_takes_reservations_back_before_refusing():
    alloc = BlockAllocator(10)
    table = BlockTable(alloc, block_size=4, extent=4)
    table.append("a", 1)  # a holds 4 blocks, 3 of them reserved
    table.append("b", 1)
    assert table.reserved("a") == 3 and table.reserved("b") == 3 and alloc.n_free == 2
    table.append("c", 12)  # 3 blocks: a's and b's reservations go back first
    assert len(table.blocks("c")) == 3 and table.reserved("a") == table.reserved("b") == 0
    assert alloc.n_free == 5
    with pytest.raises(KVCacheFull, match="asked for 6 blocks, 5 free of 10"):
        table.append("d", 24)
    assert "d" not in table and alloc.n_free == 5
    table.append_batch(["a", "b"], [4, 4])  # each needs a second block, exactly (5 free, padding wants 8)
    assert len(table.blocks("a")) == len(table.blocks("b")) == 2 and alloc.n_free == 3
    for s in ("a", "b", "c"):
        table.free(s)
    assert alloc.n_free == 10


def test_block_table_grows_and_produces_kernel_arrays():
    table = BlockTable(BlockAllocator(10), block_size=4)
    s0 = table.append("a", 6)
    s1 = table.append("b", 1)
    assert table.length("a") == 6 and len(table.blocks("a")) == 2
    b = table.blocks("a")
    np.testing.assert_array_equal(s0, [b[0] * 4, b[0] * 4 + 1, b[0] * 4 + 2, b[0] * 4 + 3, b[1] * 4, b[1] * 4 + 1])
    assert s1.tolist() == [table.blocks("b")[0] * 4]
    s2 = table.append_batch(["a", "b"], [3, 1])  # a: 6 -> 9 needs a third block, b: 1 -> 2 does not
    assert len(s2) == 4 and len(table.blocks("a")) == 3 and len(table.blocks("b")) == 1
    bt = table.block_tables(["b", "a"])
    assert bt.dtype == np.int32 and bt.shape == (2, 3)
    assert bt[0].tolist() == table.blocks("b") + [PAD, PAD]
    assert table.seq_lens(["b", "a"]).tolist() == [2, 9] and table.seq_lens(["a"]).dtype == np.int32
    assert table.block_tables(["a"], max_blocks=5).shape == (1, 5)
    with pytest.raises(ValueError, match="max_blocks"):
        table.block_tables(["a"], max_blocks=2)


def test_block_table_takes_back_the_spare_blocks_of_sequences_in_the_same_append():
    # a decode step: a holds the whole pool (its reservation) and b needs a block in the same append
    alloc = BlockAllocator(4)
    table = BlockTable(alloc, block_size=4, extent=4)
    table.append("a", 1)
    assert table.reserved("a") == 3 and alloc.n_free == 0
    table.append_batch(["a", "b"], [1, 1])
    assert table.length("a") == 2 and table.reserved("a") == 0 and len(table.blocks("b")) == 1
    assert alloc.n_free == 2


def test_block_table_is_unchanged_when_the_pool_is_full():
    alloc = BlockAllocator(3)
    table = BlockTable(alloc, block_size=4)
    table.append("a", 4)
    with pytest.raises(KVCacheFull):
        table.append_batch(["a", "b"], [5, 4])  # needs 2 + 1 = 3 blocks, 2 free
    assert table.length("a") == 4 and "b" not in table and alloc.n_free == 2
    assert table.blocks_needed("a", 5) == 2
    table.free("a")
    assert alloc.n_free == 3 and len(table) == 0


@pytest.mark.parametrize(
    "field,value",
    [("n_layers", 0), ("n_blocks", -1), ("n_kv_heads", 1.5), ("head_dim", 512), ("block_size", 0), ("dtype", "bf16")],
)
def test_kv_config_names_the_bad_field(field, value):
    args = dict(n_layers=2, n_blocks=4, n_kv_heads=3, head_dim=64)
    args[field] = value
    with pytest.raises(ValueError, match=f"KVConfig.{field}"):
        KVConfig(**args)


def test_kv_config_sizes():
    assert KVConfig(n_layers=30, n_blocks=10, n_kv_heads=3, head_dim=64).dtype == DEFAULT_KV_DTYPE
    c = KVConfig(n_layers=30, n_blocks=10, n_kv_heads=3, head_dim=64, dtype="fp16")
    assert c.block_size == 16
    assert c.bytes_per_block == 30 * 2 * 3 * 16 * 64 * 2 and c.nbytes == 10 * c.bytes_per_block
    i8 = KVConfig(n_layers=30, n_blocks=10, n_kv_heads=3, head_dim=64, dtype="int8")
    assert i8.bytes_per_block == 30 * (2 * 3 * 16 * 64 + 2 * 3 * 16 * 2)  # fp16 scales
    fit = KVConfig.from_budget(1 << 20, n_layers=30, n_kv_heads=3, head_dim=64, dtype="fp16")
    assert fit.n_blocks == (1 << 20) // c.bytes_per_block
    assert KVPool(fit).k.nbytes + KVPool(fit).v.nbytes == fit.nbytes
    with pytest.raises(ValueError, match="budget_bytes"):
        KVConfig.from_budget(100, n_layers=30, n_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_blocks_shipped_raw_between_pools_attend_the_same(dtype):
    rng = np.random.default_rng(0)
    cfg = KVConfig(n_layers=2, n_blocks=12, n_kv_heads=3, head_dim=64, dtype=dtype)
    src, dst = KVPool(cfg), KVPool(cfg)
    src_table = BlockTable(BlockAllocator(12))
    src_table.append("x", 3)  # occupy a block so the sequence does not start at block 0
    slots = src_table.append("seq", 40)
    for layer in range(2):
        src.write(
            layer,
            slots,
            rng.standard_normal((40, 3, 64)).astype(np.float32),
            rng.standard_normal((40, 3, 64)).astype(np.float32),
        )
    blocks = src_table.blocks("seq")
    run = src.read(0, blocks)
    assert np.shares_memory(run.k, src.k)  # a run of consecutive blocks is exported as views
    everything = src.read(None, blocks)  # all layers at once, leading layer axis
    assert everything.k.shape[:2] == (2, 3)
    targets = [7, 2, 9]  # land them anywhere in the destination
    dst.write_blocks(None, targets, everything.k, everything.v, k_scale=everything.k_scale, v_scale=everything.v_scale)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    lens = np.array([40], np.int32)
    for layer in range(2):
        want = src.attend(layer, q, np.array([blocks], np.int32), lens)
        got = dst.attend(layer, q, np.array([targets], np.int32), lens)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="k_blocks: expected shape"):
        dst.write_blocks(0, [1], everything.k, everything.v)
    with pytest.raises(ValueError, match="block_ids"):
        src.read(0, [12])


def test_pool_write_then_attend_matches_reference_for_smollm2_shape():
    """The model's shape end to end: 9 q heads, 3 kv heads, d=64, prompt then decode steps."""
    rng = np.random.default_rng(5)
    pool = KVPool(KVConfig(n_layers=1, n_blocks=32, n_kv_heads=3, head_dim=64, dtype="fp32"))
    table = BlockTable(BlockAllocator(32))
    ks = rng.standard_normal((50, 3, 64)).astype(np.float32)
    vs = rng.standard_normal((50, 3, 64)).astype(np.float32)
    pool.write(0, table.append(0, 45), ks[:45], vs[:45])
    for t in range(45, 50):
        pool.write(0, table.append(0, 1), ks[t : t + 1], vs[t : t + 1])
        q = rng.standard_normal((1, 9, 64)).astype(np.float32)
        out = pool.attend(0, q, table.block_tables([0]), table.seq_lens([0]))
        np.testing.assert_allclose(out, reference(q, [ks[: t + 1]], [vs[: t + 1]]), atol=5e-6)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_pool_arrays_start_on_cache_lines_and_start_zeroed(dtype):
    pool = KVPool(KVConfig(n_layers=2, n_blocks=33, n_kv_heads=3, head_dim=64, dtype=dtype))
    arrays = [pool.k, pool.v] + ([pool.k_scale, pool.v_scale] if dtype == "int8" else [])
    for arr in arrays:
        assert arr.ctypes.data % 64 == 0
        assert arr.flags.c_contiguous and arr.flags.writeable
        assert not arr.any()
    assert pool.k.shape == (2, 33, 3, 64, 16) and pool.v.shape == (2, 33, 3, 16, 64)


def test_aligned_full_fills_every_element_of_the_shape():
    from aiollm.native.arrays import aligned_full

    for shape, fill, dtype in (((7, 5), 0.25, np.float16), ((3,), 1, np.int8), ((2, 0, 4), 3.0, np.float32)):
        arr = aligned_full(shape, fill, dtype)
        assert arr.shape == shape and arr.dtype == dtype
        assert arr.size == 0 or arr.ctypes.data % 64 == 0  # an empty array has no data to place
        np.testing.assert_array_equal(arr, np.full(shape, fill, dtype))
