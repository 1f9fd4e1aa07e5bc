"""aiollm.model.linear on whatever this CPU has: the native kernel, oneDNN, or plain F.linear."""

import pytest
import torch

from aiollm.model.linear import fastest_cpu_dtype, linear, linear_add, pack
from aiollm.native import gemm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_gives_a_working_weight_on_any_cpu(dtype):
    """Whatever this CPU lacks (the native kernel needs AVX-512, oneDNN's bf16 AVX-512BW/VL/DQ), `pack` returns a
    weight that `linear` and `linear_add` multiply like the dense product (fp32 math of the same inputs)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 48, generator=g).to(dtype)
    x, r = torch.randn(5, 48, generator=g).to(dtype), torch.randn(5, 70, generator=g).to(dtype)
    packed = pack(w)
    assert packed.shape == w.shape and packed.dtype == dtype
    expected = x.float() @ w.float().T
    atol = 1e-4 if dtype == torch.float32 else 0.25  # bf16 output: one rounding of values up to ~20 (2^-8 relative)
    torch.testing.assert_close(linear(x, packed).float(), expected, atol=atol, rtol=0.01)
    torch.testing.assert_close(linear_add(x, packed, r).float(), expected + r.float(), atol=atol, rtol=0.01)


def test_fastest_cpu_dtype_names_bf16_only_where_it_is_native():
    native = gemm.supported(torch.bfloat16) or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert fastest_cpu_dtype() == ("bf16" if native else "fp32")
