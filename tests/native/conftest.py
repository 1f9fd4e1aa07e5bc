"""Helpers shared by the kernel tests: a float64 reference, pools whose unused slots are NaN, a random written
case, and the quantisers' definition."""

import numpy as np
import pytest

from aiollm.kv.pool import KVConfig, KVPool
from aiollm.native import attention


def reference(q: np.ndarray, ks: list[np.ndarray], vs: list[np.ndarray], scale: float | None = None) -> np.ndarray:
    """float64 decode attention: q [n_seqs, n_q_heads, d]; ks[i], vs[i] [len_i, n_kv_heads, d]."""
    n_seqs, n_q_heads, d = q.shape
    out = np.zeros((n_seqs, n_q_heads, d))
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    for i in range(n_seqs):
        k, v = ks[i].astype(np.float64), vs[i].astype(np.float64)
        if len(k) == 0:
            continue
        group = n_q_heads // k.shape[1]
        kh = np.repeat(k, group, axis=1)  # [len, n_q_heads, d]
        vh = np.repeat(v, group, axis=1)
        s = np.einsum("hd,thd->ht", q[i].astype(np.float64), kh) * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[i] = np.einsum("ht,thd->hd", p, vh)
    return out


def nan_pool(config: KVConfig) -> KVPool:
    """A pool whose every slot is NaN (int8 / int4: NaN scales), so reading a slot nobody wrote poisons the result."""
    pool = KVPool(config)
    if config.dtype in ("int8", "int4"):
        pool.k_scale[...] = np.nan
        pool.v_scale[...] = np.nan
    else:
        pool.k[...] = np.nan
        pool.v[...] = np.nan
    return pool


def shuffled_tables(rng, lens: list[int], block_size: int, n_blocks: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Block tables drawn from a shuffled pool (non-contiguous, interleaved between sequences), padded with -1,
    and each sequence's slot mapping."""
    need = [-(-n // block_size) for n in lens]
    ids = rng.permutation(n_blocks)[: sum(need)]
    table = np.full((len(lens), max(need + [1]) + 1), -1, np.int32)
    slots, at = [], 0
    for i, (n, k) in enumerate(zip(lens, need)):
        table[i, :k] = ids[at : at + k]
        at += k
        pos = np.arange(n)
        slots.append(table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return table, slots


@pytest.fixture
def isa_forced():
    """Force an ISA for one test and restore the probed choice afterwards."""
    yield attention.force_isa
    attention.force_isa(None)


def random_case(rng, dtype: str, head_dim: int, group: int, lens: list[int], n_kv_heads: int = 2, block_size: int = 16):
    """A NaN-poisoned pool (2 layers) whose layer 1 holds N(0,1) K/V of sequences of `lens` in shuffled blocks:
    (pool, table, slots, seq_lens, q, ks, vs), q N(0,1) [n_seqs, n_kv_heads * group, head_dim]."""
    n_blocks = sum(-(-n // block_size) for n in lens) + 8
    pool = nan_pool(
        KVConfig(
            n_layers=2, n_blocks=n_blocks, n_kv_heads=n_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype
        )
    )
    table, slots = shuffled_tables(rng, lens, block_size, n_blocks)
    ks = [rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32) for n in lens]
    vs = [rng.standard_normal((n, n_kv_heads, head_dim)).astype(np.float32) for n in lens]
    for s, k, v in zip(slots, ks, vs):
        pool.write(1, s, k, v)
    q = rng.standard_normal((len(lens), n_kv_heads * group, head_dim)).astype(np.float32)
    return pool, table, slots, np.array(lens, np.int32), q, ks, vs


def expected_codes(x: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, fp16 scale) of rows x [..., D] (float32) by kv_write's definition, in float32 arithmetic: s = max|x| /
    qmax ignoring NaNs, rounded to fp16 (a finite s past fp16's range as 65504), codes round(clamp(x / s, -qmax,
    qmax)), ties to even, a NaN element as -qmax, x / s taken as 0 where s is 0 or infinite."""
    mag = np.abs(x)
    amax = np.where(np.isnan(mag), np.float32(0), mag).max(axis=-1, keepdims=True).astype(np.float32)
    s = amax / np.float32(qmax)
    scale = np.where(np.isfinite(s) & (s > 65504), np.float32(65504), s).astype(np.float16)
    back = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where((back > 0) & np.isfinite(back), np.float32(1) / back, np.float32(0)).astype(np.float32)
        y = (x * inv).astype(np.float32)
    y = np.where(np.isnan(y), np.float32(-qmax), np.clip(y, -qmax, qmax))
    return np.rint(y).astype(np.int8), scale[..., 0]


def assert_codes_equal_the_definition(
    pool: KVPool, slots: np.ndarray, k: np.ndarray, v: np.ndarray, unpack, qmax: int
) -> None:
    """Layer 0's codes (through `unpack`, e.g. int8_logical) and fp16 scales at `slots` are those of k, v by
    `expected_codes`, bit for bit."""
    bs = pool.config.block_size
    b, o = slots // bs, slots % bs
    k_codes, v_codes = unpack(pool.k[0], pool.v[0])
    for want_x, codes, scales in (
        (k, k_codes[b, :, :, o], pool.k_scale[0][b, :, o]),
        (v, v_codes[b, :, o, :], pool.v_scale[0][b, :, o]),
    ):
        want_codes, want_scales = expected_codes(want_x, qmax)
        np.testing.assert_array_equal(codes, want_codes)
        np.testing.assert_array_equal(scales.view(np.uint16), want_scales.view(np.uint16))
