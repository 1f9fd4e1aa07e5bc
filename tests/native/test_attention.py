"""decode_attention against a float64 reference, over every ISA path, storage dtype, head_dim and GQA ratio,
on the library's pool and on the OpenMP team (`on_gemm_team`)."""

import itertools
import os
import zlib

import numpy as np
import pytest

from aiollm.native import attention
from tests.native.conftest import random_case, reference

# Tolerances (absolute, outputs are averages of N(0,1) values so they are O(1)).
FP32_ATOL = 5e-6  # fp32 storage vs the float64 reference: fp32 rounding over up to 4097 tokens
FP16_ATOL = 5e-6  # fp16 storage vs the float64 reference fed the same fp16-rounded K/V: math is fp32
INT8_ATOL = 0.06  # int8 storage vs the float64 reference of fp32 K/V: K/V quantisation (max|x|/254 per element)
#                   and, on the dot-product paths, q per row and softmax weights per chunk quantised too (VNNI
#                   weights to 1/510 of the chunk's largest, AVX2's to 1/254); seen <= 0.03
OUT_FP16_ATOL = 2e-3  # fp16 output: one fp16 rounding of an O(1) value (2^-11 relative, ~4 ulp slack)
OUT_BF16_ATOL = 2e-2  # bf16 output: one bf16 rounding (2^-8 relative)

AWKWARD_LENGTHS = [1, 3, 15, 16, 17, 33, 255, 1023, 4097]
ISAS = attention.supported_isas()
INT8_PATHS = attention.supported_int8_paths()
# int8 on each SIMD ISA once per int8 path it runs: fp32 math, and its own int8 dot products (VNNI on AVX-512,
# vpmaddubsw on AVX2); the reference path computes fp32 whatever the path says
ISA_INT8_PATHS = {
    isa: [p for p in INT8_PATHS if p == "fp32" or {"avx512": "vnni", "avx2": "madd"}.get(isa) == p]
    for isa in ISAS
    if isa != "ref"
}
GRID = [
    (isa, dtype, d, g, path)
    for isa, dtype, d, g in itertools.product(ISAS, ("fp32", "fp16", "int8"), (64, 80, 128), (1, 3, 4, 8))
    for path in (ISA_INT8_PATHS.get(isa, [None]) if dtype == "int8" else [None])
]


@pytest.fixture(params=["pool", "team"])
def runner(request):
    """Run the test's attention calls on the pool, or on torch's OpenMP team (torch loaded, so the team exists)."""
    if request.param == "pool":
        yield
        return
    import torch  # noqa: F401  (loads libgomp, which the team path needs)

    with attention.on_gemm_team():
        yield


@pytest.fixture
def int8_forced():
    """Force an int8 path for one test and restore the probed choice afterwards."""
    yield attention.force_int8_path
    attention.force_int8_path(None)


@pytest.mark.parametrize("isa,dtype,head_dim,group,int8_path", GRID)
def test_matches_float64_reference(isa_forced, int8_forced, runner, isa, dtype, head_dim, group, int8_path):
    rng = np.random.default_rng(zlib.crc32(repr((isa, dtype, head_dim, group)).encode()))  # not hash(): salted
    # every awkward length appears in each sequence set; the grid rotates which lengths share a batch
    lens = AWKWARD_LENGTHS[GRID.index((isa, dtype, head_dim, group, int8_path)) % 3 :: 3]
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, dtype, head_dim, group, lens)
    isa_forced(isa)
    int8_forced(int8_path)
    out = pool.attend(1, q, table, seq_lens, n_threads=2)
    if dtype == "fp16":
        ks = [k.astype(np.float16) for k in ks]
        vs = [v.astype(np.float16) for v in vs]
    expected = reference(q, ks, vs)
    atol = {"fp32": FP32_ATOL, "fp16": FP16_ATOL, "int8": INT8_ATOL}[dtype]
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "isa,int8_path", [(isa, None) for isa in ISAS] + [(isa, p) for isa, paths in ISA_INT8_PATHS.items() for p in paths]
)
@pytest.mark.parametrize("dtype,block_size", [("fp16", 8), ("fp16", 32), ("int8", 32), ("int8", 6)])
def test_other_block_sizes(isa_forced, int8_forced, runner, isa, int8_path, dtype, block_size):
    """block_size 8 is not a multiple of 16 (reference path); 32 has two 16-token chunks per block; int8 with 6
    has a last group of 2 tokens in its interleaved V layout."""
    rng = np.random.default_rng(7)
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, dtype, 64, 3, [5, 40, 77], block_size=block_size)
    isa_forced(isa)
    int8_forced(int8_path)
    out = pool.attend(1, q, table, seq_lens)
    if dtype == "fp16":
        expected = reference(q, [k.astype(np.float16) for k in ks], [v.astype(np.float16) for v in vs])
        np.testing.assert_allclose(out, expected, rtol=0, atol=FP16_ATOL)
    else:
        np.testing.assert_allclose(out, reference(q, ks, vs), rtol=0, atol=INT8_ATOL)


def test_isa_in_use_is_reported_and_forcing_an_unknown_one_raises(isa_forced):
    assert attention.isa() in ISAS
    assert "ref" in ISAS
    with pytest.raises(ValueError, match="isa"):
        isa_forced("sse9")
    isa_forced("ref")
    assert attention.isa() == "ref"


def test_int8_paths_are_reported_and_forcing_an_unknown_one_raises(int8_forced):
    assert attention.int8_path() in INT8_PATHS or not INT8_PATHS
    with pytest.raises(ValueError, match="int8 path"):
        int8_forced("int3")


@pytest.mark.skipif(
    "vnni" not in INT8_PATHS or "AIOLLM_ATTN_INT8" in os.environ or "AIOLLM_ATTN_ISA" in os.environ,
    reason="needs AVX512-VNNI and the probed ISA and int8 path",
)
def test_probed_vnni_path_leaves_group_1_to_avx2_madd_unless_forced(isa_forced, int8_forced):
    """On Zen 5 the probed AVX-512 VNNI path runs a GQA group of 1 in the AVX2 kernel's MADD dot products (they
    read faster from DRAM there, native/dispatch.c); larger groups take VNNI, as every call does on other CPUs; a
    forced ISA or int8 path serves every call."""
    rng = np.random.default_rng(11)
    rule = bool(attention.lib.aiollm_cpu_int8_group1_madd())
    for group, n_threads, probed_takes in (
        (1, 2, "madd" if rule else "vnni"),
        (1, 1, "madd" if rule else "vnni"),
        (3, 2, "vnni"),
    ):
        pool, table, _, seq_lens, q, _, _ = random_case(rng, "int8", 128, group, [40, 300])
        isa_forced(None)
        int8_forced(None)
        assert attention.isa() == "avx512" and attention.int8_path() == "vnni"
        probed = pool.attend(1, q, table, seq_lens, n_threads=n_threads)
        forced = {}
        for isa, path in (("avx512", "fp32"), ("avx512", "vnni"), ("avx2", "madd")):
            isa_forced(isa)
            int8_forced(path)
            forced[path] = pool.attend(1, q, table, seq_lens, n_threads=n_threads)
        np.testing.assert_array_equal(probed, forced[probed_takes])
        assert not np.array_equal(forced["madd"], forced["vnni"])
        int8_forced(None)
        isa_forced("avx512")  # a forced ISA keeps its own kernel: the probed VNNI path
        np.testing.assert_array_equal(pool.attend(1, q, table, seq_lens, n_threads=n_threads), forced["vnni"])


@pytest.fixture
def far_forced():
    """Force the far prefetch level for one test and restore the probed choice afterwards."""
    yield attention.force_far_prefetch
    attention.force_far_prefetch(None)


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "ref"])
@pytest.mark.parametrize(
    "dtype,head_dim,group", [("fp16", 64, 3), ("fp16", 128, 1), ("fp32", 80, 4), ("int8", 64, 3), ("int8", 128, 1)]
)
def test_far_prefetch_on_and_off_give_identical_outputs(isa_forced, far_forced, isa, dtype, head_dim, group):
    """Prefetches never change what is computed: the two settings agree bit for bit (long, shuffled tables,
    so the far level reaches across many blocks and past the end of each sequence)."""
    rng = np.random.default_rng(7)
    pool, table, _, seq_lens, q, _, _ = random_case(rng, dtype, head_dim, group, [4097, 700, 33, 1])
    isa_forced(isa)
    outs = []
    for on in (True, False):
        far_forced(on, dtype)
        assert attention.far_prefetch(dtype) is on
        outs.append(pool.attend(1, q, table, seq_lens, n_threads=2))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa != "ref"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_every_int8_far_level_gives_identical_outputs(isa_forced, isa, dtype):
    """The int8 / int4 far levels (none, whole tiles, lines, both) compute the same bits on each SIMD kernel, on items
    of many heads (8 kv heads of d=128: past PHASE_I8_BYTES / MANY_HEADS_I8_BYTES, where the line form applies) and of
    few (2 heads of d=64)."""
    from aiollm._native import lib

    rng = np.random.default_rng(9)
    isa_forced(isa)
    try:
        for n_kv_heads, head_dim in ((8, 128), (2, 64)):
            pool, table, _, seq_lens, q, _, _ = random_case(rng, dtype, head_dim, 1, [1500, 300, 17], n_kv_heads)
            outs = []
            for mask in (0, lib.AIOLLM_FAR_QUANTISED, lib.AIOLLM_FAR_QUANTISED_LINES, lib.AIOLLM_FAR_ALL):
                assert lib.aiollm_set_far_prefetch(mask) == lib.AIOLLM_OK
                outs.append(pool.attend(1, q, table, seq_lens, n_threads=2))
            for out in outs[1:]:
                np.testing.assert_array_equal(out, outs[0])
    finally:
        attention.force_far_prefetch(None)


def test_far_prefetch_default_follows_the_cpu_and_bad_values_raise(far_forced):
    from aiollm._native import lib

    far_forced(None)
    default = lib.aiollm_cpu_far_prefetch_default()
    if "AIOLLM_ATTN_FAR_PREFETCH" not in os.environ:
        for storage, bit in (("fp32", 1), ("fp16", 1), ("int8", 6), ("int4", 6)):
            assert attention.far_prefetch(storage) is bool(default & bit)
    with pytest.raises(ValueError, match="far prefetch"):
        far_forced(2)
    with pytest.raises(ValueError, match="far prefetch: storage expected one of"):
        far_forced(True, "bf16")
    with pytest.raises(ValueError, match="far prefetch: storage"):
        attention.far_prefetch("int3")
    assert lib.aiollm_set_far_prefetch(lib.AIOLLM_FAR_ALL + 1) == lib.AIOLLM_ERR_ARG


def test_far_prefetch_is_set_per_storage_class(far_forced):
    """fp32 and fp16 share one setting, int8 and int4 the other; forcing one class leaves the other as it was, and
    None puts both back."""
    probed = {s: attention.far_prefetch(s) for s in ("fp16", "int8")}
    for on in (True, False):
        far_forced(not on)
        far_forced(on, "int4")
        assert (attention.far_prefetch("int8"), attention.far_prefetch("int4")) == (on, on)
        assert (attention.far_prefetch("fp16"), attention.far_prefetch("fp32")) == (not on, not on)
        far_forced(on, "fp32")
        assert attention.far_prefetch("fp16") is on
    far_forced(None)
    assert {s: attention.far_prefetch(s) for s in ("fp16", "int8")} == probed


def test_zero_length_sequence_gives_zero_row():
    rng = np.random.default_rng(1)
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, "fp32", 64, 3, [0, 20])
    out = pool.attend(1, q, table, seq_lens)
    assert (out[0] == 0).all()
    np.testing.assert_allclose(out[1], reference(q[1:], ks[1:], vs[1:])[0], atol=FP32_ATOL)


@pytest.mark.parametrize("out_dtype,atol", [("fp16", OUT_FP16_ATOL), ("bf16", OUT_BF16_ATOL)])
def test_reduced_precision_outputs(out_dtype, atol):
    rng = np.random.default_rng(2)
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, "fp16", 64, 3, [33, 100])
    out = pool.attend(1, q, table, seq_lens, out_dtype=out_dtype)
    got = out.float().numpy() if out_dtype == "bf16" else out.astype(np.float32)
    expected = reference(q, [k.astype(np.float16) for k in ks], [v.astype(np.float16) for v in vs])
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def test_custom_scale_and_out_buffer_written_in_place():
    rng = np.random.default_rng(3)
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, "fp32", 64, 1, [19, 64])
    out = np.full(q.shape, np.nan, np.float32)
    result = pool.attend(1, q, table, seq_lens, scale=0.3, out=out)
    assert result is out
    np.testing.assert_allclose(out, reference(q, ks, vs, scale=0.3), atol=FP32_ATOL)


def test_torch_tensors_in_and_out_without_copies():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, "fp16", 64, 3, [17, 50])
    out = torch.empty(q.shape, dtype=torch.float32)
    result = pool.attend(1, torch.from_numpy(q), torch.from_numpy(table), torch.from_numpy(seq_lens), out=out)
    assert result is out
    expected = reference(q, [k.astype(np.float16) for k in ks], [v.astype(np.float16) for v in vs])
    np.testing.assert_allclose(out.numpy(), expected, atol=FP16_ATOL)


def test_q_may_be_a_slice_of_a_fused_qkv_row():
    rng = np.random.default_rng(5)
    pool, table, _, seq_lens, q, ks, vs = random_case(rng, "fp32", 64, 3, [9, 31, 70])
    fused = np.zeros((3, q.shape[1] + 4, 64), np.float32)  # q heads then k and v heads, like a QKV projection
    fused[:, : q.shape[1]] = q
    out = pool.attend(1, fused[:, : q.shape[1]], table, seq_lens)
    np.testing.assert_allclose(out, reference(q, ks, vs), atol=FP32_ATOL)
