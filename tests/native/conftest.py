"""Helpers shared by the kernel tests: a float64 reference and pools whose unused slots are NaN."""
import numpy as np
import pytest

from aiollm.kv import attention
from aiollm.kv.pool import KVConfig, KVPool


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
        table[i, :k] = ids[at:at + k]
        at += k
        pos = np.arange(n)
        slots.append(table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    return table, slots


@pytest.fixture
def isa_forced():
    """Force an ISA for one test and restore the probed choice afterwards."""
    yield attention.force_isa
    attention.force_isa(None)
