"""int8 kv_write bit for bit: the SSE2 quantiser (head_dim a multiple of 16) and the portable one (any other
head_dim) store exactly what the definition gives — scale s = max|x| / 127 ignoring NaNs, rounded to fp16 (a finite
s beyond fp16's range as 65504), codes round(clamp(x / s, -127, 127)), ties to even, a NaN element as -127, x / s
taken as 0 where s is 0 or infinite — for ordinary, zero, tiny, fp16-subnormal, huge, inf and NaN rows."""

import numpy as np
import pytest

from aiollm.kv.pool import KVConfig, KVPool, int8_logical
from tests.native.conftest import assert_codes_equal_the_definition


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (16, 16), (24, 16), (5, 16), (5, 6)])
def test_int8_codes_and_scales_equal_the_definition(head_dim, block_size):
    rng = np.random.default_rng(head_dim)
    n, heads = 40, 3
    x = (rng.standard_normal((n, heads, head_dim)) * rng.uniform(1e-3, 1e3, (n, heads, 1))).astype(np.float32)
    x[0, 0, 1] = np.nan
    x[1, 1] = 0
    x[2, 2, 0] = np.inf
    x[3, 0] = -1e-30
    x[4, 1, -1] = -np.inf
    x[5, 2] = 3e38
    x[6, 0] = np.nan
    x[7, 1, :] = 2.5  # with max|x| = 127 the codes are x itself: ties round to even (2, 0, -2), not away
    x[7, 1, :3] = [127.0, 0.5, -1.5]
    x[8, 2] *= 1e-4 / np.abs(x[8, 2]).max()  # s ~7.9e-7: an fp16 subnormal, whose codes still fill [-127, 127]
    x[9, 0, 0] = 1e7  # s ~78740: past fp16's largest, stored as 65504; the codes saturate
    v = x[::-1].copy()
    pool = KVPool(
        KVConfig(n_layers=1, n_blocks=8, n_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype="int8")
    )
    slots = rng.permutation(8 * block_size)[:n].astype(np.int64)
    pool.write(0, slots, x, v)
    assert_codes_equal_the_definition(pool, slots, x, v, int8_logical, 127)
