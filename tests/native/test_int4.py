"""int4 KV storage: kv_write's codes and scales against the definition, bit for bit; decode_attention against a
float64 reference of the dequantised K/V (what the kernel must compute) on every ISA and int8 path, and against
fp32 K/V (what the quantisation costs); and the arguments int4 refuses."""

import itertools
import zlib

import numpy as np
import pytest

from aiollm.kv.pool import KVConfig, KVPool, int4_logical
from aiollm.native import attention
from tests.native.conftest import assert_codes_equal_the_definition, random_case, reference

# Tolerances (absolute; outputs are averages of N(0,1) values, so O(1)).
DEQUANT_FP32_ATOL = 2e-5  # fp32 math (the reference path) vs float64 over the same dequantised K/V
DEQUANT_DOT_ATOL = 0.05  # int8 dot products (MADD): q quantised per row to 1/254 of its largest element and
#                          each chunk's softmax weights to 1/254 of the chunk's largest; seen <= 0.025
# int4 vs fp32 K/V: each element moves by up to max|row| / 14 (~0.25 for N(0,1) rows of 64). Over a few tokens
# the output carries that error unaveraged and K's error shifts the weights too; over hundreds it averages out.
# How far depends on how few tokens the softmax leans on; measured over 60 random cases and the grid:
FP32_KV_ATOL_SHORT = 0.6  # lengths < 64: seen <= 0.44 (length 3)
FP32_KV_ATOL_MID = 0.45  # lengths 64-511: seen <= 0.31 (100), 0.18 (64), 0.13 (255)
FP32_KV_ATOL_LONG = 0.12  # lengths >= 512: seen <= 0.046 (1023), 0.017 (4097)

AWKWARD_LENGTHS = [1, 3, 15, 16, 17, 33, 255, 1023, 4097]
ISAS = attention.supported_isas()
PATHS = attention.supported_int8_paths()
# each ISA with each int8 path that selects a different int4 kernel: fp32 (the reference path) and the dot products
GRID = [
    (isa, path, d, g)
    for isa, path, d, g in itertools.product(ISAS, PATHS, (32, 64, 96, 128), (1, 3, 4, 8))
    if isa != "ref" or path == "fp32"
]


@pytest.fixture
def int8_forced():
    yield attention.force_int8_path
    attention.force_int8_path(None)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 4), (96, 8), (128, 32)])
def test_int4_codes_and_scales_equal_the_definition(head_dim, block_size):
    rng = np.random.default_rng(head_dim)
    n, heads = 30, 2
    x = (rng.standard_normal((n, heads, head_dim)) * rng.uniform(1e-3, 1e3, (n, heads, 1))).astype(np.float32)
    x[0, 0, 1] = np.nan
    x[1, 1] = 0
    x[2, 0, 0] = np.inf
    x[3, 1, -1] = -np.inf
    x[4, 0] = 3e38
    x[5, 1, :] = 0.5  # with max|x| = 7 the codes are x itself: ties round to even (0, 2, -2)
    x[5, 1, :3] = [7.0, 2.5, -1.5]
    x[6, 0, 0] = 1e6  # s ~142857: past fp16's largest, stored as 65504; the codes saturate
    v = x[::-1].copy()
    pool = KVPool(
        KVConfig(n_layers=1, n_blocks=8, n_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype="int4")
    )
    slots = rng.permutation(8 * block_size)[:n].astype(np.int64)
    pool.write(0, slots, x, v)
    assert_codes_equal_the_definition(pool, slots, x, v, int4_logical, 7)
    k_codes, _ = int4_logical(pool.k[0], pool.v[0])
    # a slot nobody wrote keeps its zero bytes (the codes of two neighbours share a byte only within a token)
    untouched = np.setdiff1d(np.arange(8 * block_size), slots)[0]
    assert (k_codes[untouched // block_size, :, :, untouched % block_size] == -8).all()


def _dequantised(pool: KVPool, slots: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each sequence's K and V [len, n_kv_heads, head_dim] as the pool holds them: codes times scales."""
    bs = pool.config.block_size
    k_codes, v_codes = int4_logical(pool.k[1], pool.v[1])
    ks, vs = [], []
    for s in slots:
        b, o = s // bs, s % bs
        ks.append(k_codes[b, :, :, o] * pool.k_scale[1][b, :, o][..., None].astype(np.float32))
        vs.append(v_codes[b, :, o, :] * pool.v_scale[1][b, :, o][..., None].astype(np.float32))
    return ks, vs


@pytest.mark.parametrize("isa,path,head_dim,group", GRID)
def test_int4_matches_float64_reference(isa_forced, int8_forced, isa, path, head_dim, group):
    rng = np.random.default_rng(zlib.crc32(repr((isa, path, head_dim, group)).encode()))  # not hash(): salted
    lens = AWKWARD_LENGTHS[GRID.index((isa, path, head_dim, group)) % 3 :: 3]
    pool, table, slots, seq_lens, q, ks, vs = random_case(rng, "int4", head_dim, group, lens)
    isa_forced(isa)
    int8_forced(path)
    out = pool.attend(1, q, table, seq_lens, n_threads=2)
    assert np.isfinite(out).all()
    dk, dv = _dequantised(pool, slots)
    atol = DEQUANT_FP32_ATOL if isa == "ref" or path == "fp32" else DEQUANT_DOT_ATOL
    np.testing.assert_allclose(out, reference(q, dk, dv), rtol=0, atol=atol)
    exact = reference(q, ks, vs)
    for i, n in enumerate(lens):
        atol = FP32_KV_ATOL_SHORT if n < 64 else FP32_KV_ATOL_MID if n < 512 else FP32_KV_ATOL_LONG
        np.testing.assert_allclose(out[i], exact[i], rtol=0, atol=atol, err_msg=f"length {n}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_size", [4, 8, 32])
def test_int4_other_block_sizes(isa_forced, isa, block_size):
    """4 and 8 are not multiples of 16 (the reference path); 32 has two 16-token chunks per block."""
    rng = np.random.default_rng(block_size)
    pool, table, slots, seq_lens, q, _, _ = random_case(rng, "int4", 64, 3, [5, 40, 77], block_size=block_size)
    isa_forced(isa)
    dk, dv = _dequantised(pool, slots)
    atol = DEQUANT_FP32_ATOL if isa == "ref" or attention.int8_path() == "fp32" else DEQUANT_DOT_ATOL
    np.testing.assert_allclose(pool.attend(1, q, table, seq_lens), reference(q, dk, dv), rtol=0, atol=atol)


def test_int4_tiles_are_half_the_int8_bytes_and_ship_between_pools():
    args = dict(n_layers=2, n_blocks=6, n_kv_heads=3, head_dim=64)
    i4, i8 = KVConfig(**args, dtype="int4"), KVConfig(**args, dtype="int8")
    assert i4.bytes_per_block == 2 * (2 * 3 * 16 * 64 // 2 + 2 * 3 * 16 * 2)
    assert i8.bytes_per_block - i4.bytes_per_block == 2 * 3 * 16 * 64
    src, dst = KVPool(i4), KVPool(i4)
    assert src.k.shape == (2, 6, 3, 64, 8) and src.v.shape == (2, 6, 3, 16, 32) and src.k.dtype == np.uint8
    rng = np.random.default_rng(3)
    slots = np.arange(16, 16 + 30, dtype=np.int64)  # blocks 1 and 2
    src.write(
        1,
        slots,
        rng.standard_normal((30, 3, 64)).astype(np.float32),
        rng.standard_normal((30, 3, 64)).astype(np.float32),
    )
    raw = src.read(None, [1, 2])
    dst.write_blocks(None, [5, 0], raw.k, raw.v, k_scale=raw.k_scale, v_scale=raw.v_scale)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    lens = np.array([30], np.int32)
    np.testing.assert_array_equal(
        dst.attend(1, q, np.array([[5, 0]], np.int32), lens), src.attend(1, q, np.array([[1, 2]], np.int32), lens)
    )


@pytest.mark.parametrize("head_dim,block_size", [(80, 16), (64, 6)])
def test_int4_refuses_a_geometry_its_layout_cannot_hold(head_dim, block_size):
    with pytest.raises(ValueError, match="int4 needs head_dim % 32 == 0 and block_size % 4 == 0"):
        KVConfig(n_layers=1, n_blocks=2, n_kv_heads=1, head_dim=head_dim, block_size=block_size, dtype="int4")
    k = np.zeros((2, 1, head_dim, block_size // 2), np.uint8)
    v = np.zeros((2, 1, block_size // 2 * 2, head_dim // 2), np.uint8)
    scales = np.zeros((2, 1, block_size // 2 * 2), np.float16)
    with pytest.raises(ValueError, match="int4 \\(uint8\\) storage needs head_dim % 32 == 0"):
        attention.kv_write(
            k,
            v,
            np.zeros(1, np.int64),
            np.zeros((1, 1, head_dim), np.float32),
            np.zeros((1, 1, head_dim), np.float32),
            k_scale=scales,
            v_scale=scales,
        )


def test_int4_cache_needs_scales_and_matching_v():
    k = np.zeros((4, 2, 64, 8), np.uint8)
    v = np.zeros((4, 2, 16, 32), np.uint8)
    q = np.zeros((1, 2, 64), np.float32)
    tables, lens = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    with pytest.raises(ValueError, match="k_scale: required for an int4 cache"):
        attention.decode_attention(k, v, q, tables, lens)
    with pytest.raises(ValueError, match="v_cache: expected shape \\(4, 2, 16, 32\\)"):
        attention.decode_attention(k, np.zeros((4, 2, 16, 64), np.uint8), q, tables, lens)
    with pytest.raises(ValueError, match="v_cache: expected dtype uint8"):
        attention.decode_attention(k, np.zeros((4, 2, 16, 32), np.int8), q, tables, lens)
