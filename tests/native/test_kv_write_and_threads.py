"""kv_write conversions and quantisation, the thread pool, the ISA env var and the read-bandwidth probe."""

import concurrent.futures
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest

from aiollm.kv.pool import KVConfig, KVPool, int4_logical, int8_logical
from aiollm.native import attention
from tests.native.conftest import reference, shuffled_tables

INT8_STEP = 1 / 127  # int8 dequantisation error <= scale / 2 = max|x| / 254 per element; compared at max|x| / 127
INT4_STEP = 1 / 7  # int4: <= max|x| / 14 per element


def _pool(dtype, n_blocks=16, head_dim=64, n_kv_heads=2):
    return KVPool(KVConfig(n_layers=1, n_blocks=n_blocks, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype))


def _logical(pool, slots):
    """Read back tokens [n, n_kv_heads, head_dim] as floats from the pool's layout (dequantised for int8 / int4)."""
    bs = pool.config.block_size
    b, o = slots // bs, slots % bs
    unpack = {"int8": int8_logical, "int4": int4_logical}.get(pool.config.dtype, lambda k, v: (k, v))
    k_tiles, v_tiles = unpack(pool.k[0], pool.v[0])
    k = k_tiles[b, :, :, o].astype(np.float64)  # [n, heads, dim] (K transposed inside the block)
    v = v_tiles[b, :, o, :].astype(np.float64)
    if pool.k_scale is not None:
        k *= pool.k_scale[0][b, :, o][..., None]
        v *= pool.v_scale[0][b, :, o][..., None]
    return k, v


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
def test_write_round_trips_through_the_layout(dtype):
    rng = np.random.default_rng(0)
    pool = _pool(dtype)
    slots = rng.permutation(16 * 16)[:37].astype(np.int64)
    k = rng.standard_normal((37, 2, 64)).astype(np.float32)
    v = rng.standard_normal((37, 2, 64)).astype(np.float32) * 5
    pool.write(0, slots, k, v)
    got_k, got_v = _logical(pool, slots)
    if dtype in ("int8", "int4"):
        step = INT8_STEP if dtype == "int8" else INT4_STEP
        for got, want in ((got_k, k), (got_v, v)):
            bound = np.abs(want).max(axis=-1, keepdims=True) * step / 2 * 1.001
            assert (np.abs(got - want) <= bound).all()
    else:
        np.testing.assert_array_equal(got_k, k.astype(np.float16 if dtype == "fp16" else np.float32))
        np.testing.assert_array_equal(got_v, v.astype(np.float16 if dtype == "fp16" else np.float32))


def test_fp16_conversion_rounds_to_nearest_even_like_numpy():
    pool = _pool("fp16", n_blocks=64, n_kv_heads=1)
    # edge values: subnormals, the largest half, values that round to inf, ties
    specials = np.array(
        [
            0.0,
            -0.0,
            1e-8,
            6e-8,
            3e-5,
            6.1e-5,
            65504.0,
            65519.0,
            65520.0,
            1e6,
            -1e6,
            1.00048828125,
            1.00146484375,
            np.inf,
            -np.inf,
        ],
        np.float32,
    )
    x = np.concatenate(
        [specials, np.random.default_rng(1).standard_normal(64 * 64 - len(specials)).astype(np.float32) * 100]
    )
    k = x.reshape(64, 1, 64)
    slots = np.arange(64, dtype=np.int64)
    pool.write(0, slots, k, k)
    got_k, _ = _logical(pool, slots)
    with np.errstate(over="ignore"):  # numpy warns when 65520 and 1e6 become inf, which is the point
        np.testing.assert_array_equal(got_k.astype(np.float16), k.astype(np.float16))


def _edge_rows(rng, n_tokens, heads, head_dim):
    """fp32 rows with every fp16 edge: NaNs with payloads and signs, infinities, subnormals and values past the
    smallest one, the largest half and the ties around it, ties between halves, and ordinary values."""
    bits = np.array(
        [
            0x7FC00000,
            0xFFC00001,
            0x7F800001,
            0x7FBFFFFF,
            0x7F800000,
            0xFF800000,
            0x00000001,
            0x33000000,
            0x33000001,
            0x387FC000,
            0x38800000,
            0x477FE000,
            0x477FEFFF,
            0x477FF000,
            0x3F801000,
            0x3F803000,
            0x80000000,
            0x00000000,
        ],
        np.uint32,
    ).view(np.float32)
    x = rng.standard_normal(n_tokens * heads * head_dim) * 10.0 ** rng.integers(-9, 6, n_tokens * heads * head_dim)
    x = x.astype(np.float32)
    x[rng.choice(x.size, len(bits), replace=False)] = bits
    return x.reshape(n_tokens, heads, head_dim)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("in_dtype", ["fp32", "fp16", "bf16"])
def test_stored_bytes_do_not_depend_on_the_isa(isa_forced, dtype, in_dtype):
    """The F16C path (any SIMD ISA) stores exactly what the portable loops store, edge values included."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    slots = rng.permutation(32 * 16)[:200].astype(np.int64)
    k = torch.from_numpy(_edge_rows(rng, 200, 2, 64)).to(
        getattr(torch, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[in_dtype])
    )
    v = torch.flip(k, (0,)).contiguous()
    stored = {}
    for isa in attention.supported_isas():
        isa_forced(isa)
        pool = _pool(dtype, n_blocks=32)
        pool.write(0, slots, k, v)
        stored[isa] = [a.tobytes() for a in (pool.k, pool.v, pool.k_scale, pool.v_scale) if a is not None]
    for isa, arrays in stored.items():
        assert arrays == stored["ref"], f"{isa} stored other bytes than the portable path"


def test_bf16_and_fp16_inputs_and_int32_slots():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    k = torch.from_numpy(rng.standard_normal((5, 2, 64)).astype(np.float32))
    for dtype in (torch.bfloat16, torch.float16):
        pool = _pool("fp32")
        slots = torch.tensor([3, 40, 41, 100, 200], dtype=torch.int32)
        pool.write(0, slots, k.to(dtype), k.to(dtype))
        got_k, got_v = _logical(pool, slots.numpy().astype(np.int64))
        np.testing.assert_array_equal(got_k, k.to(dtype).float().numpy())
        np.testing.assert_array_equal(got_v, k.to(dtype).float().numpy())


def test_write_accepts_k_and_v_sliced_from_a_fused_projection():
    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((6, 3 + 2 + 2, 64)).astype(np.float32)  # [tokens, q heads + k heads + v heads, dim]
    pool = _pool("fp32")
    slots = np.arange(6, dtype=np.int64) * 5
    pool.write(0, slots, qkv[:, 3:5], qkv[:, 5:7])
    got_k, got_v = _logical(pool, slots)
    np.testing.assert_array_equal(got_k, qkv[:, 3:5])
    np.testing.assert_array_equal(got_v, qkv[:, 5:7])


def _big_case(seed=0):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(1, 600, size=24)]
    n_blocks = sum(-(-n // 16) for n in lens)
    pool = _pool("fp16", n_blocks=n_blocks, n_kv_heads=3)
    table, slots = shuffled_tables(rng, lens, 16, n_blocks)
    for s in slots:
        pool.write(
            0,
            s,
            rng.standard_normal((len(s), 3, 64)).astype(np.float32),
            rng.standard_normal((len(s), 3, 64)).astype(np.float32),
        )
    q = rng.standard_normal((len(lens), 9, 64)).astype(np.float32)
    return pool, q, table, np.array(lens, np.int32)


def test_results_do_not_depend_on_the_thread_count():
    pool, q, table, lens = _big_case()
    outs = [pool.attend(0, q, table, lens, n_threads=n) for n in (1, 2, 3, 8)]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])  # one item is one thread's work: bitwise equal
    assert attention.pool_size() >= 8


def test_concurrent_calls_from_python_threads():
    pool, q, table, lens = _big_case(1)
    expected = pool.attend(0, q, table, lens, n_threads=1)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda _: pool.attend(0, q, table, lens, n_threads=2), range(8)))
    for out in outs:
        np.testing.assert_array_equal(out, expected)


def test_on_the_gemm_team_results_equal_the_pools():
    pool, q, table, lens = _big_case(3)
    expected = pool.attend(0, q, table, lens, n_threads=1)
    with attention.on_gemm_team():
        outs = [pool.attend(0, q, table, lens, n_threads=n) for n in (1, 2, 3, 8)]
        with concurrent.futures.ThreadPoolExecutor(3) as ex:  # other threads stay on the pool (or use their team)
            outs += list(ex.map(lambda _: pool.attend(0, q, table, lens, n_threads=2), range(3)))
    for out in outs:
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("forced_pool", [False, True])
def test_on_the_gemm_team_leaves_the_pool_unstarted(forced_pool):
    """In a fresh process with torch's OpenMP runtime loaded, attention on the team starts no pool worker;
    AIOLLM_ATTN_POOL=1 sends it back to the pool."""
    code = (
        "import torch; import numpy as np; from aiollm.native import attention; "
        "from tests.native.test_kv_write_and_threads import _big_case\n"
        "pool, q, table, lens = _big_case(4)\n"
        "with attention.on_gemm_team(): pool.attend(0, q, table, lens, n_threads=2)\n"
        "print(attention.pool_size())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("AIOLLM_ATTN_POOL", "AIOLLM_GEMM_POOL")}
    if forced_pool:
        env["AIOLLM_ATTN_POOL"] = "1"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert got.strip() == ("2" if forced_pool else "1")


def _attend_in_child(conn):
    pool, q, table, lens = _big_case(2)
    conn.send(pool.attend(0, q, table, lens, n_threads=2))


def test_pool_works_in_a_forked_child():
    pool, q, table, lens = _big_case(2)
    expected = pool.attend(0, q, table, lens, n_threads=2)  # the parent's pool is started before the fork
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_attend_in_child, args=(child,))
    proc.start()
    try:
        assert parent.poll(30), "child did not answer (pool deadlocked after fork?)"
        np.testing.assert_array_equal(parent.recv(), expected)
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("name", ["ref", "avx2", "avx512"])
def test_env_var_selects_the_isa(name):
    code = "from aiollm.native import attention; print(attention.isa())"
    env = dict(os.environ, AIOLLM_ATTN_ISA=name)
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert got == (name if name in attention.supported_isas() else attention.supported_isas()[-1])


@pytest.mark.parametrize("n_threads", [1, 2])
def test_read_sum_reads_every_byte(isa_forced, n_threads):
    buf = np.arange(1 << 20, dtype=np.float32) % 7  # 4 MiB, exact in fp32 partial sums
    for name in attention.supported_isas():
        isa_forced(name)
        assert attention.read_sum(buf, n_threads) == pytest.approx(float(buf.sum(dtype=np.float64)), rel=1e-6)
    with pytest.raises(ValueError, match="buf"):
        attention.read_sum(buf[:3])


def test_reference_helper_is_softmax_weighted_average():
    """The oracle itself: one token gives back its V row; equal scores give the mean."""
    v = np.arange(2 * 1 * 4, dtype=np.float32).reshape(2, 1, 4)
    k = np.zeros((2, 1, 4), np.float32)
    out = reference(np.ones((1, 2, 4), np.float32), [k], [v])
    np.testing.assert_allclose(out[0, 0], v.mean(axis=0)[0])
    np.testing.assert_allclose(reference(np.ones((1, 1, 4), np.float32), [k[:1]], [v[:1]])[0, 0], v[0, 0])
