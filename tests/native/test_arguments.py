"""Bad arguments raise ValueError/TypeError naming the argument before C runs; C rejects them on its own too."""

import numpy as np
import pytest

from aiollm._native import ffi, lib
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.native import attention

H, G, D, BS = 2, 3, 64, 16


@pytest.fixture
def setup():
    pool = KVPool(KVConfig(n_layers=1, n_blocks=8, n_kv_heads=H, head_dim=D, block_size=BS, dtype="fp16"))
    q = np.zeros((2, H * G, D), np.float32)
    table = np.array([[0, 1, -1], [2, -1, -1]], np.int32)
    lens = np.array([20, 16], np.int32)
    return pool, q, table, lens


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.update(q=a["q"].astype(np.float64)), "q: expected dtype fp32, got"),
        (lambda a: a.update(q=np.zeros((2, 7, D), np.float32)), "q: expected n_q_heads a multiple of n_kv_heads=2"),
        (lambda a: a.update(q=np.zeros((2, H * G, 32), np.float32)), r"q: expected shape \(n_seqs, n_q_heads, 64\)"),
        (
            lambda a: a.update(q=np.zeros((2, H * G, 2 * D), np.float32)[:, :, ::2]),
            "q: expected a contiguous from dim 1",
        ),
        (lambda a: a.update(q=[[0.0]]), "q: expected a numpy array or a torch CPU tensor, got list"),
        (lambda a: a.update(block_tables=a["block_tables"].astype(np.int64)), "block_tables: expected dtype int32"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), r"block_tables: expected shape \(2, max_blocks\)"),
        (
            lambda a: a.update(block_tables=np.array([[0, 9, -1], [2, -1, -1]], np.int32)),
            r"block_tables: expected entries in use in \[0, 8\), got 9 at \[0, 1\]",
        ),
        (lambda a: a.update(block_tables=np.array([[0, -1, -1], [2, -1, -1]], np.int32)), "got -1 at"),
        (
            lambda a: a.update(seq_lens=np.array([20, 49], np.int32)),
            "seq_lens: sequence 1 has length 49, needing 4 blocks",
        ),
        (lambda a: a.update(seq_lens=np.array([20, -1], np.int32)), "seq_lens: expected lengths >= 0, got -1"),
        (lambda a: a.update(seq_lens=np.array([20], np.int32)), r"seq_lens: expected shape \(2,\)"),
        (
            lambda a: a.update(out=np.zeros((2, H * G, D), np.float64)),
            "out: expected dtype fp32 or fp16 or bf16, got float64",
        ),
        (lambda a: a.update(out=np.zeros((1, H * G, D), np.float32)), r"out: expected shape \(2, 6, 64\)"),
        (lambda a: a.update(out_dtype="int8"), "out_dtype: expected 'fp32', 'fp16' or 'bf16'"),
        (lambda a: a.update(n_threads=0), "n_threads: expected an int in"),
    ],
)
def test_attend_rejects(setup, change, match):
    pool, q, table, lens = setup
    args = {"q": q, "block_tables": table, "seq_lens": lens}
    change(args)
    with pytest.raises((ValueError, TypeError), match=match):
        pool.attend(0, **args)


def test_layer_out_of_range(setup):
    pool, q, table, lens = setup
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 1\), got 1"):
        pool.attend(1, q, table, lens)


@pytest.mark.parametrize(
    "change,match",
    [
        (
            lambda a: a.update(slot_mapping=np.array([0, 128], np.int64)),
            r"slot_mapping: expected entries in \[0, 128\), got 128 at index 1",
        ),
        (lambda a: a.update(slot_mapping=np.array([0, 1], np.float32)), "slot_mapping: expected dtype int64 or int32"),
        (lambda a: a.update(k=np.zeros((2, H, 32), np.float32)), r"k: expected shape \(2, 2, 64\)"),
        (lambda a: a.update(v=np.zeros((2, H, D), np.float16)), "v: expected the dtype of k"),
        (lambda a: a.update(k=np.zeros((2, H, D), np.int32)), "k: expected dtype fp32 or fp16 or bf16"),
    ],
)
def test_write_rejects(setup, change, match):
    pool = setup[0]
    args = {
        "slot_mapping": np.array([0, 1], np.int64),
        "k": np.zeros((2, H, D), np.float32),
        "v": np.zeros((2, H, D), np.float32),
    }
    change(args)
    with pytest.raises(ValueError, match=match):
        pool.write(0, **args)


def test_int8_cache_needs_scales():
    k = np.zeros((4, H, D, BS), np.int8)
    v = np.zeros((4, H, BS, D), np.int8)
    with pytest.raises(ValueError, match="k_scale: required for an int8 cache"):
        attention.decode_attention(
            k, v, np.zeros((1, H, D), np.float32), np.zeros((1, 1), np.int32), np.ones(1, np.int32)
        )


def test_v_cache_must_match_k_cache():
    k = np.zeros((4, H, D, BS), np.float16)
    with pytest.raises(ValueError, match=r"v_cache: expected shape \(4, 2, 16, 64\)"):
        attention.decode_attention(
            k,
            np.zeros((4, H, D, BS), np.float16),
            np.zeros((1, H, D), np.float32),
            np.zeros((1, 1), np.int32),
            np.ones(1, np.int32),
        )


def _c_layer(k, v):
    desc = ffi.new("aiollm_kv_layer *")
    desc.k, desc.v = ffi.cast("void *", k.ctypes.data), ffi.cast("void *", v.ctypes.data)
    desc.n_blocks, desc.block_size, desc.n_kv_heads, desc.head_dim, desc.dtype = k.shape[0], BS, H, D, lib.AIOLLM_DT_F16
    return desc


def test_c_checks_bounds_on_its_own():
    """Bypassing the Python checks: C still refuses before touching memory."""
    k = np.zeros((4, H, D, BS), np.float16)
    v = np.zeros((4, H, BS, D), np.float16)
    desc = _c_layer(k, v)
    q = np.zeros((1, H * G, D), np.float32)
    out = np.zeros_like(q)

    def call(table, lens):
        table = np.asarray(table, np.int32)
        lens = np.asarray(lens, np.int32)
        return lib.aiollm_decode_attention(
            desc,
            ffi.cast("float *", q.ctypes.data),
            H * G * D,
            1,
            H * G,
            ffi.cast("int32_t *", table.ctypes.data),
            table.shape[1],
            ffi.cast("int32_t *", lens.ctypes.data),
            0.125,
            ffi.cast("void *", out.ctypes.data),
            lib.AIOLLM_DT_F32,
            1,
        )

    assert call([[0, 1]], [32]) == lib.AIOLLM_OK
    assert call([[0, 4]], [32]) == lib.AIOLLM_ERR_BLOCK
    assert call([[0, -5]], [17]) == lib.AIOLLM_ERR_BLOCK
    assert call([[0, 1]], [33]) == lib.AIOLLM_ERR_LEN
    assert call([[0, 1]], [-1]) == lib.AIOLLM_ERR_LEN
    assert call([[0, 1]], [2**31 - 1]) == lib.AIOLLM_ERR_LEN
    slots = np.array([0, 4 * BS], np.int64)
    kin = np.zeros((2, H, D), np.float32)
    rc = lib.aiollm_kv_write(
        desc,
        ffi.cast("int64_t *", slots.ctypes.data),
        2,
        ffi.cast("void *", kin.ctypes.data),
        H * D,
        ffi.cast("void *", kin.ctypes.data),
        H * D,
        lib.AIOLLM_DT_F32,
    )
    assert rc == lib.AIOLLM_ERR_SLOT
    rc = lib.aiollm_kv_write(
        desc,
        ffi.cast("int64_t *", slots.ctypes.data),
        1,
        ffi.cast("void *", kin.ctypes.data),
        H * D - 1,
        ffi.cast("void *", kin.ctypes.data),
        H * D,
        lib.AIOLLM_DT_F32,
    )
    assert rc == lib.AIOLLM_ERR_ARG
