"""Sliding-window decode attention (`window`: each query attends to its sequence's last `window` tokens) and the
head widths of the supported model families (64, 80, 96, 128), on every ISA path and storage dtype, against the
float64 reference over the same tokens. The pool's unused slots are NaN, so a read outside the sequence fails."""

import itertools
import zlib

import numpy as np
import pytest

from aiollm.kv.pool import KVConfig, KVPool
from aiollm.native import attention
from tests.native.conftest import random_case, reference

FP32_ATOL = 5e-6  # fp32 / fp16 storage vs the float64 reference of the same values: fp32 rounding
INT8_ATOL = 0.06  # int8 storage vs the float64 reference of fp32 K/V (as in test_attention.py)
INT4_ATOL = 0.6  # int4 storage: 7 levels a side per token and head

ISAS = attention.supported_isas()
LENGTHS = [1, 3, 15, 16, 17, 33, 40, 255, 300]
WINDOWS = [1, 7, 16, 17, 32, 100]


def _int8_paths(isa: str) -> list[str]:
    own = {"avx512": "vnni", "avx2": "madd"}.get(isa)
    return [p for p in attention.supported_int8_paths() if p == "fp32" or p == own] if isa != "ref" else ["fp32"]


GRID = [
    (isa, dtype, d, path)
    for isa, dtype, d in itertools.product(ISAS, ("fp32", "fp16", "int8", "int4"), (64, 80, 96, 128))
    if not (dtype == "int4" and d % 32)
    for path in (_int8_paths(isa) if dtype in ("int8", "int4") else [None])
]


@pytest.fixture
def forced():
    yield
    attention.force_isa(None)
    attention.force_int8_path(None)


@pytest.mark.parametrize("isa,dtype,head_dim,int8_path", GRID)
def test_window_matches_reference_over_the_last_tokens(forced, isa, dtype, head_dim, int8_path):
    attention.force_isa(isa)
    if int8_path is not None:
        attention.force_int8_path(int8_path)
    rng = np.random.default_rng(zlib.crc32(repr((isa, dtype, head_dim, int8_path)).encode()))
    group = 4
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, dtype, head_dim, group, LENGTHS)
    atol = {"fp32": FP32_ATOL, "fp16": FP32_ATOL, "int8": INT8_ATOL, "int4": INT4_ATOL}[dtype]
    if dtype == "fp16":
        ks = [k.astype(np.float16) for k in ks]
        vs = [v.astype(np.float16) for v in vs]
    layer = {"k_cache": pool.k[1], "v_cache": pool.v[1], "k_scale": None, "v_scale": None}
    if pool.k_scale is not None:
        layer.update(k_scale=pool.k_scale[1], v_scale=pool.v_scale[1])
    for window in WINDOWS:
        out = attention.decode_attention(**layer, q=q, block_tables=table, seq_lens=seq_lens, window=window)
        expected = reference(q, [k[-window:] for k in ks], [v[-window:] for v in vs])
        np.testing.assert_allclose(out, expected, rtol=0, atol=atol, err_msg=f"window {window}")
    whole = attention.decode_attention(**layer, q=q, block_tables=table, seq_lens=seq_lens, window=0)
    np.testing.assert_allclose(whole, reference(q, ks, vs), rtol=0, atol=atol)


@pytest.mark.parametrize("isa", ISAS)
def test_pool_with_a_window_honours_it_in_attend_and_in_a_prepared_step(forced, isa):
    attention.force_isa(isa)
    rng = np.random.default_rng(7)
    lens, window, d = [40, 9, 70], 24, 96
    _, table, slots, seq_lens, q, ks, vs = random_case(rng, "fp32", d, 2, lens)
    pool = KVPool(KVConfig(n_layers=2, n_blocks=int(table.max()) + 1, n_kv_heads=2, head_dim=d, window=window))
    for s, k, v in zip(slots, ks, vs):
        pool.write(1, s, k, v)
    expected = reference(q, [k[-window:] for k in ks], [v[-window:] for v in vs])
    np.testing.assert_allclose(pool.attend(1, q, table, seq_lens), expected, rtol=0, atol=FP32_ATOL)
    step = pool.prepare_decode(np.array([s[-1] for s in slots]), table, seq_lens)
    out = np.empty(q.shape, np.float32)
    step.attend(1, q, out)
    np.testing.assert_allclose(out, expected, rtol=0, atol=FP32_ATOL)


def test_negative_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        KVConfig(n_layers=1, n_blocks=1, n_kv_heads=1, head_dim=64, window=-1)
    pool = KVPool(KVConfig(n_layers=1, n_blocks=1, n_kv_heads=1, head_dim=64))
    with pytest.raises(ValueError, match="window"):
        attention.decode_attention(
            pool.k[0],
            pool.v[0],
            np.zeros((1, 1, 64), np.float32),
            np.zeros((1, 1), np.int32),
            np.ones(1, np.int32),
            window=-2,
        )
