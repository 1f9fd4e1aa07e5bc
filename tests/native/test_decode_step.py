"""KVPool.prepare_decode: one step's index arrays checked once, then every layer's write/attend equals the
per-call path and still rejects bad per-layer arguments before C runs."""

import gc

import numpy as np
import pytest

from aiollm.kv.pool import KVConfig, KVPool

H, G, D, BS, L = 2, 3, 64, 16, 3


@pytest.fixture
def pool():
    return KVPool(KVConfig(n_layers=L, n_blocks=8, n_kv_heads=H, head_dim=D, block_size=BS, dtype="fp32"))


def _step_args():
    table = np.array([[0, 1, -1], [2, -1, -1]], np.int32)
    lens = np.array([20, 16], np.int32)
    slots = np.array([19, 47], np.int64)  # the last token of each sequence
    return slots, table, lens


def test_same_result_as_per_call_path(pool):
    rng = np.random.default_rng(0)
    pool.k[:] = rng.standard_normal(pool.k.shape, np.float32)
    pool.v[:] = rng.standard_normal(pool.v.shape, np.float32)
    other = KVPool(pool.config)
    other.k[:], other.v[:] = pool.k, pool.v
    slots, table, lens = _step_args()
    step = pool.prepare_decode(slots, table, lens)
    for layer in range(L):
        k, v = (rng.standard_normal((2, H, D), np.float32) for _ in range(2))
        q = rng.standard_normal((2, H * G, D), np.float32)
        step.write(layer, k, v)
        got = step.attend(layer, q, np.empty_like(q))
        other.write(layer, slots, k, v)
        want = other.attend(layer, q, table, lens)
        np.testing.assert_array_equal(got, want)


def test_keeps_its_own_copies(pool):
    slots, table, lens = _step_args()
    step = pool.prepare_decode(slots, table, lens)
    table[0, 0], lens[0], slots[0] = 99, 1000, -5  # the checked step must not see these
    q = np.ones((2, H * G, D), np.float32)
    step.write(0, np.ones((2, H, D), np.float32), np.ones((2, H, D), np.float32))
    step.attend(0, q, np.empty_like(q))


def test_outlives_its_pool():
    """A step whose pool is dropped still attends over that pool's memory (it keeps the pool alive)."""
    pool = KVPool(KVConfig(n_layers=L, n_blocks=8, n_kv_heads=H, head_dim=D, block_size=BS, dtype="fp32"))
    pool.v[:] = 2.0
    step = pool.prepare_decode(*_step_args())
    shape = pool.v.shape
    del pool
    gc.collect()
    reuse = [np.full(shape, np.nan, np.float32) for _ in range(4)]  # would land in freed pool memory
    q = np.ones((2, H * G, D), np.float32)
    out = step.attend(0, q, np.empty_like(q))
    np.testing.assert_array_equal(out, np.full_like(q, 2.0))
    assert np.isnan(reuse[0]).all()


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(block_tables=a["block_tables"].astype(np.int64)), "block_tables: expected dtype int32"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), r"block_tables: expected shape \(2, max_blocks\)"),
        (
            lambda a: a.update(block_tables=np.array([[0, 9, -1], [2, -1, -1]], np.int32)),
            r"block_tables: expected entries in use in \[0, 8\), got 9 at \[0, 1\]",
        ),
        (
            lambda a: a.update(seq_lens=np.array([20, 49], np.int32)),
            "seq_lens: sequence 1 has length 49, needing 4 blocks",
        ),
        (lambda a: a.update(seq_lens=np.array([20, -1], np.int32)), "seq_lens: expected lengths >= 0, got -1"),
        (lambda a: a.update(seq_lens=np.array([20], np.int32)), r"seq_lens: expected shape \(2,\)"),
        (
            lambda a: a.update(slot_mapping=np.array([0, 128], np.int64)),
            r"slot_mapping: expected entries in \[0, 128\), got 128",
        ),
        (lambda a: a.update(slot_mapping=np.array([0, 1], np.float32)), "slot_mapping: expected dtype int64 or int32"),
    ],
)
def test_prepare_rejects(pool, change, match):
    slots, table, lens = _step_args()
    args = {"slot_mapping": slots, "block_tables": table, "seq_lens": lens}
    change(args)
    with pytest.raises(ValueError, match=match):
        pool.prepare_decode(**args)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda s, q, kv: s.attend(L, q, np.empty_like(q)), r"layer: expected an int in \[0, 3\), got 3"),
        (lambda s, q, kv: s.attend(0, q.astype(np.float64), np.empty_like(q)), "q: expected dtype fp32"),
        (lambda s, q, kv: s.attend(0, q[:1], np.empty_like(q[:1])), r"q: expected shape \(2, n_q_heads, 64\)"),
        (
            lambda s, q, kv: s.attend(0, np.zeros((2, 7, D), np.float32), np.zeros((2, 7, D), np.float32)),
            "q: expected n_q_heads a multiple of n_kv_heads=2",
        ),
        (lambda s, q, kv: s.attend(0, q, np.empty((1, H * G, D), np.float32)), r"out: expected shape \(2, 6, 64\)"),
        (lambda s, q, kv: s.attend(0, q, np.empty(q.shape, np.float64)), "out: expected dtype fp32 or fp16 or bf16"),
        (lambda s, q, kv: s.write(0, kv[:, :, :32], kv[:, :, :32]), r"k: expected shape \(2, 2, 64\)"),
        (lambda s, q, kv: s.write(0, kv, kv.astype(np.float16)), "v: expected the dtype of k"),
        (lambda s, q, kv: s.write(-1, kv, kv), "layer: expected an int in"),
    ],
)
def test_layer_calls_reject(pool, call, match):
    step = pool.prepare_decode(*_step_args())
    with pytest.raises(ValueError, match=match):
        call(step, np.zeros((2, H * G, D), np.float32), np.zeros((2, H, D), np.float32))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_write_attend_equals_write_then_attend(pool, dtype):
    """One packed qkv [rows, q heads + k + v, d], rows strided as an R-worker's slice of a mini-batch is: the
    same cache contents and the same output as `write` and `attend` of its three parts."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    pool.k[:] = rng.standard_normal(pool.k.shape, np.float32)
    pool.v[:] = rng.standard_normal(pool.v.shape, np.float32)
    other = KVPool(pool.config)
    other.k[:], other.v[:] = pool.k, pool.v
    step, ref = pool.prepare_decode(*_step_args()), other.prepare_decode(*_step_args())
    wide = torch.from_numpy(rng.standard_normal((2, H * G + 2 * H + 1, D), np.float32))
    wide = wide.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    qkv = wide[:, : H * G + 2 * H]  # rows one head wider than the packed heads: a row stride of its own
    for layer in range(L):
        got = step.write_attend(layer, qkv, torch.empty(2, H * G, D))
        ref.write(layer, qkv[:, H * G : H * G + H], qkv[:, H * G + H :])
        want = ref.attend(layer, qkv[:, : H * G].float(), torch.empty(2, H * G, D))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    np.testing.assert_array_equal(pool.k, other.k)
    np.testing.assert_array_equal(pool.v, other.v)


@pytest.mark.parametrize(
    "qkv,match",
    [
        (np.zeros((1, H * G + 2 * H, D), np.float32), r"qkv: expected shape \(2, n_q_heads \+ 2 x 2, 64\)"),
        (np.zeros((2, 2 * H, D), np.float32), r"qkv: expected shape \(2, n_q_heads \+ 2 x 2, 64\), got \(2, 4, 64\)"),
        (np.zeros((2, H * G + 2 * H, D), np.float64), "qkv: expected dtype fp32 or fp16 or bf16"),
        (np.zeros((2, D, H * G + 2 * H), np.float32).transpose(0, 2, 1), "qkv: expected a contiguous from dim 1"),
        (np.zeros((2, 7 + 2 * H, D), np.float32), "q: expected n_q_heads a multiple of n_kv_heads=2"),
    ],
)
def test_write_attend_rejects(pool, qkv, match):
    step = pool.prepare_decode(*_step_args())
    before = pool.k.copy()
    with pytest.raises(ValueError, match=match):
        step.write_attend(0, qkv, np.empty((2, qkv.shape[1] - 2 * H, D), np.float32))
    np.testing.assert_array_equal(pool.k, before)  # checked before anything is stored
