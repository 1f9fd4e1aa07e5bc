"""The native skinny GEMM (aiollm.native.gemm) against a float64 reference, on awkward shapes."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from aiollm.model.linear import linear, linear_add, pack
from aiollm.native import gemm

# fp32: products and sums in fp32, K <= 1536 terms of O(1) values: relative to the largest output
FP32_RTOL = 2e-5
# bf16: exact bf16 products summed in fp32, then rounded once to bf16 (relative error 2^-8 of the value)
BF16_RTOL = 2**-8

DTYPES = [d for d in (torch.float32, torch.bfloat16) if gemm.supported(d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="this CPU has no native GEMM (AVX-512)")

# M: 1, tails of the 8-row tile, several tiles, past the 256-row chunk; N: partial panels and 3-panel blocks;
# K: the model's (576, 1536), odd, below one 32-wide bf16 step. bf16 with K % 32 == 0 runs on AMX where the CPU
# has it, any other K on AVX512_BF16, so the grid covers both.
SHAPES = [
    (1, 16, 32),
    (1, 1, 1),
    (3, 17, 5),
    (7, 33, 64),
    (8, 48, 576),
    (9, 50, 33),
    (17, 960, 576),
    (64, 576, 1536),
    (33, 1000, 577),
    (300, 100, 64),
    (15, 47, 31),
    (16, 49, 255),
]


def _reference(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> np.ndarray:
    out = x.double().numpy() @ w.double().numpy().T
    return out if r is None else out + r.double().numpy()


def _check(y: torch.Tensor, ref: np.ndarray, dtype: torch.dtype) -> None:
    scale = max(np.abs(ref).max(), 1e-30)
    got = y.double().numpy()
    if dtype == torch.float32:
        assert np.abs(got - ref).max() <= FP32_RTOL * scale
    else:  # each output is the fp32 sum (error ~K * 2^-24 of the scale) rounded to bf16
        assert np.all(np.abs(got - ref) <= BF16_RTOL * np.abs(ref) + 1e-5 * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_matches_float64_reference(dtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    packed = gemm.PackedWeight(w)
    assert torch.equal(packed.to_dense(), w)
    _check(gemm.gemm(x, packed), _reference(x, w, None), dtype)
    _check(gemm.gemm(x, packed, r), _reference(x, w, r), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_and_thread_counts_give_the_same_result(dtype):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 96, generator=g).to(dtype)
    wide = torch.randn(21, 160, generator=g).to(dtype)
    x = wide[:, 10:106]  # rows 160 elements apart
    packed = gemm.PackedWeight(w)
    one = gemm.gemm(x, packed, n_threads=1)
    assert torch.equal(one, gemm.gemm(x.contiguous(), packed, n_threads=1))
    for threads in (2, 3, 8):
        assert torch.equal(one, gemm.gemm(x, packed, n_threads=threads))
    _check(one, _reference(x, w, None), dtype)


def test_fp32_residual_add_is_bit_identical_to_adding_afterwards():
    g = torch.Generator().manual_seed(3)
    w, x, r = torch.randn(100, 64, generator=g), torch.randn(9, 64, generator=g), torch.randn(9, 100, generator=g)
    packed = gemm.PackedWeight(w)
    assert torch.equal(gemm.gemm(x, packed, r), gemm.gemm(x, packed) + r)


def test_nan_in_x_reaches_only_its_row():
    w = torch.randn(40, 32)
    x = torch.randn(10, 32)
    x[4, 7] = float("nan")
    y = gemm.gemm(x, gemm.PackedWeight(w))
    assert torch.isnan(y[4]).all()
    assert not torch.isnan(y[torch.arange(10) != 4]).any()


def test_zero_rows_give_an_empty_result():
    assert gemm.gemm(torch.empty(0, 32), gemm.PackedWeight(torch.randn(20, 32))).shape == (0, 20)


def test_bad_arguments_raise_naming_the_argument():
    packed = gemm.PackedWeight(torch.randn(20, 32))
    with pytest.raises(TypeError, match="x: expected torch.float32"):
        gemm.gemm(torch.randn(4, 32, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match=r"x: expected shape \[m, 32\]"):
        gemm.gemm(torch.randn(4, 31), packed)
    with pytest.raises(ValueError, match="x: rows must be unit-stride"):
        gemm.gemm(torch.randn(32, 4).T, packed)
    with pytest.raises(ValueError, match=r"residual: expected shape \[4, 20\]"):
        gemm.gemm(torch.randn(4, 32), packed, torch.randn(5, 20))
    with pytest.raises(TypeError, match="residual: expected torch.float32"):
        gemm.gemm(torch.randn(4, 32), packed, torch.randn(4, 20, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="weight: expected a PackedWeight"):
        gemm.gemm(torch.randn(4, 32), torch.randn(20, 32))
    with pytest.raises(TypeError, match="weight: expected float32 or bfloat16"):
        gemm.PackedWeight(torch.randn(20, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="weight: expected a non-empty 2-D"):
        gemm.PackedWeight(torch.randn(20))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_uses_the_native_kernel_and_agrees_with_dense(dtype):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(70, 48, generator=g).to(dtype)
    x, r = torch.randn(5, 48, generator=g).to(dtype), torch.randn(5, 70, generator=g).to(dtype)
    packed = pack(w)
    assert isinstance(packed, gemm.PackedWeight) and packed.shape == w.shape and packed.dtype == dtype
    _check(linear(x, packed), _reference(x, w, None), dtype)
    _check(linear_add(x, packed, r), _reference(x, w, r), dtype)


def test_library_pool_path_gives_the_same_bits_as_torchs_openmp_team():
    """GEMMs run on torch's OpenMP team when torch's libgomp is loaded; AIOLLM_GEMM_POOL=1 (read once per process)
    keeps them on the library's own pool. Both must give the same result."""
    script = (
        "import torch\nfrom aiollm.native import gemm\ng = torch.Generator().manual_seed(5)\n"
        "w, x = torch.randn(300, 64, generator=g), torch.randn(40, 64, generator=g)\n"
        "y = gemm.gemm(x, gemm.PackedWeight(w), n_threads=2)\n"
        "print(float((y.double() - x.double() @ w.double().T).abs().max()), y.sum().item().hex())\n"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "AIOLLM_GEMM_POOL": pool},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()
        for pool in ("0", "1")
    ]
    assert outs[0][1] == outs[1][1]
    assert float(outs[0][0]) < 1e-3


@pytest.mark.skipif(torch.float32 not in DTYPES, reason="no fp32 native GEMM")
def test_small_batches_give_the_bits_of_the_same_rows_in_a_large_batch():
    # m <= 16 prefetches each tile's own panels, larger m the next block: the arithmetic is the same, so each
    # row's bits must not depend on the batch it came in (n: many blocks, a partial panel; k: the model's and odd)
    g = torch.Generator().manual_seed(11)
    for n, k in ((4099, 576), (50, 33), (576, 1536)):
        packed = gemm.PackedWeight(torch.randn(n, k, generator=g))
        x = torch.randn(64, k, generator=g)
        r = torch.randn(64, n, generator=g)
        full, full_r = gemm.gemm(x, packed), gemm.gemm(x, packed, r)
        for m in (1, 2, 8, 15, 16, 17, 24):
            assert torch.equal(gemm.gemm(x[:m], packed), full[:m]), (n, k, m)
            assert torch.equal(gemm.gemm(x[:m], packed, r[:m]), full_r[:m]), (n, k, m)


def test_slabs_hand_out_aligned_disjoint_ranges_and_start_new_slabs_on_2mib_boundaries():
    slabs = gemm._Slabs()
    slabs.SLAB_BYTES = 4 << 20
    sizes = [300_001, 1 << 20, 3_000_000, 5 << 20, 64, 2_500_000]
    taken = [slabs.take(n) for n in sizes]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in taken)
    assert all(t.numel() == n and t.data_ptr() % 64 == 0 for t, n in zip(taken, sizes))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert taken[3].data_ptr() % (2 << 20) == 0  # 5 MiB does not fit the 4 MiB slab: a slab of its own
    for i, t in enumerate(taken):
        t.fill_(i)
    assert all(int(t.min()) == int(t.max()) == i for i, t in enumerate(taken))
