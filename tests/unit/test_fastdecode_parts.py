"""FastDecode's pure parts: placement by expected length, the mini-batch split, the R-worker's sequence store
(whole-life reservation, all-or-nothing refusal, release), and the S-worker's flags."""

import numpy as np
import pytest
import torch

from aiollm.deploy.roles import parse_role_args, r_worker_urls
from aiollm.deploy.roles.s_worker import s_worker_config
from aiollm.errors import KVCacheFull
from aiollm.kv.pool import KVConfig
from aiollm.sched.sls import SLSConfig
from aiollm.serving.fastdecode.pipeline import _packed, _worker_slices, minibatches, place
from aiollm.serving.fastdecode.r_worker import SequenceStore
from aiollm.serving.fastdecode.s_worker import SWorkerConfig
from aiollm.sizes import parse_size


def test_place_balances_expected_total_length():
    expected = [0, 0]
    chosen = []
    for max_len in [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]:
        w = place(expected, max_len)
        expected[w] += max_len
        chosen.append(w)
    assert expected == [100, 100]  # the long one alone on worker 0, the ten short ones on worker 1
    assert chosen[0] == 0 and set(chosen[1:]) == {1}
    assert place([5, 0, 0], 1, refused=frozenset({1})) == 2
    with pytest.raises(ValueError):
        place([0], 1, refused=frozenset({0}))


def test_minibatches_give_every_worker_rows_in_both_halves():
    workers = [1, 0, 1, 0, 1, 1, 0]
    a, b = minibatches(workers, pipeline=True)
    assert sorted(a + b) == list(range(7))
    for half in (a, b):
        assert [workers[i] for i in half] == sorted(workers[i] for i in half)  # sorted by worker
        assert {workers[i] for i in half} == {0, 1}
    assert minibatches([0], pipeline=True) == [[0]]
    assert minibatches(workers, pipeline=False) == [[1, 3, 6, 0, 2, 4, 5]]
    assert _worker_slices([0, 0, 1, 1, 1, 3]) == [(0, slice(0, 2)), (1, slice(2, 5)), (3, slice(5, 6))]
    assert _worker_slices([]) == []


def _store(n_blocks=8):
    return SequenceStore(KVConfig(n_layers=2, n_blocks=n_blocks, n_kv_heads=1, head_dim=4, block_size=4, dtype="fp32"))


def test_packed_views_adjacent_qkv_and_copies_otherwise():
    qkv = torch.randn(5, 9 + 2 * 3, 4, dtype=torch.bfloat16)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    packed = _packed(q, k, v)
    assert packed.data_ptr() == qkv.data_ptr() and torch.equal(packed, qkv)  # a view, no copy
    for args in ((q.clone(), k, v), (q, v, k), (q, k, v.float().to(torch.bfloat16))):
        copied = _packed(*args)
        assert copied.data_ptr() != qkv.data_ptr() and torch.equal(copied, torch.cat(args, dim=1))
    rows = qkv[::2]  # strided rows: not the packed layout
    assert torch.equal(_packed(rows[:, :9], rows[:, 9:12], rows[:, 12:]), rows)


def test_store_reserves_whole_life_and_refuses_all_or_nothing():
    store = _store()
    store.admit(0, 3, 20)  # 5 blocks for its whole life
    assert store.load().blocks_used == 5 and store.load().tokens == 3
    with pytest.raises(KVCacheFull):
        store.admit(1, 5, 16)  # 4 blocks, 3 free
    assert store.load().sequences == 1 and store.load().blocks_used == 5
    slots, tables, lens = store.begin_step(np.array([0]), np.array([3]))
    assert lens.tolist() == [4] and tables.shape == (1, 1) and slots.tolist() == [int(tables[0, 0]) * 4 + 3]
    slots, tables, lens = store.begin_step(np.array([0]), np.array([4]))
    assert lens.tolist() == [5] and tables.shape == (1, 2) and slots.tolist() == [int(tables[0, 1]) * 4]
    # the same step again (after another R-worker was lost) overwrites its entry instead of appending
    again, _, lens = store.begin_step(np.array([0]), np.array([4]))
    assert lens.tolist() == [5] and again.tolist() == slots.tolist() and store.load().tokens == 5
    with pytest.raises(ValueError, match="gap"):
        store.begin_step(np.array([0]), np.array([6]))
    store.release(0)
    assert store.load().blocks_used == 0 and store.load().sequences == 0
    store.admit(1, 5, 16)
    with pytest.raises(ValueError):
        store.admit(1, 5, 16)


def test_store_hands_each_sequence_its_blocks_in_ascending_order():
    store = _store()
    store.admit(0, 3, 32)  # all 8 blocks
    first = store.blocks[0].tolist()
    store.release(0)  # freed in order: the allocator hands them back last-in first-out, i.e. reversed
    store.admit(1, 3, 32)
    assert first == store.blocks[1].tolist() == sorted(first)


def test_store_stops_at_the_reserved_length():
    store = _store()
    store.admit(0, 3, 4)
    store.begin_step(np.array([0]), np.array([3]))
    with pytest.raises(ValueError, match="reserved length"):
        store.begin_step(np.array([0]), np.array([4]))


def test_sizes_urls_and_config():
    assert parse_size("8GiB") == 8 * 2**30 and parse_size("1.5GB") == 1_500_000_000 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="memory size"):
        parse_size("8 parsecs")
    assert r_worker_urls("tcp://127.0.0.1:7001,tcp://127.0.0.1:7002/rw") == (
        "tcp://127.0.0.1:7001/r-worker",
        "tcp://127.0.0.1:7002/rw",
    )
    argv = ["--r-workers", "tcp://127.0.0.1:7001", "--max-batch", "64", "--pipeline-min-batch", "32"]
    spec, wiring = parse_role_args("s-worker", [*argv, "--sls-interval", "16", "--sls-seq-len", "256"])
    assert wiring.r_workers == ("tcp://127.0.0.1:7001/r-worker",)
    config = s_worker_config(spec)
    assert config.pipeline and config.pipeline_min_batch == 32 and config.schedule.micro_batch_size == 4
    assert not s_worker_config(parse_role_args("s-worker", [*argv, "--no-pipeline"])[0]).pipeline
    with pytest.raises(ValueError, match="batch_size"):
        SWorkerConfig(max_batch=8, schedule=SLSConfig(batch_size=4, seq_len=16, interval=4))
