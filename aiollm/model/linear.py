"""The S-part's matrix products: each weight packed once at load time for the fastest kernel on its device.

On a CPU with AVX-512 (fp32) or AVX512_BF16 (bf16) the weight becomes an aiollm.native.gemm.PackedWeight
and products run on the native skinny GEMM, which streams the weights at close to the machine's read
bandwidth at small batch and reuses them from L2 across the rows of larger ones. oneDNN's packed GEMMs
(the fallback) read SmolLM2's weights at only ~15 GB/s at batch 8 and reach 140-200 GFLOPS at batch 32-64;
`F.linear` (MKL sgemm) re-packs the weight on every call and is
slower still. Elsewhere (CUDA, no oneDNN) weights stay dense and `F.linear` is used.
"""

import functools

import torch
import torch.nn.functional as F

from aiollm.native import gemm

Weight = torch.Tensor | gemm.PackedWeight


def pack(weight: torch.Tensor) -> Weight:
    """The weight [out, in] in the fastest layout for `linear` on its device: a PackedWeight for the native
    kernel, else a oneDNN tensor on CPU, else the tensor itself. All three have `.shape`, `.dtype` and
    `.to_dense()` (a plain tensor's is itself)."""
    if weight.device.type == "cpu" and gemm.supported(weight.dtype):
        return gemm.PackedWeight(weight)
    if (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (weight.dtype == torch.float32 or weight.dtype == torch.bfloat16 and _onednn_bf16())
    ):
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return weight


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN has bf16 GEMMs on this CPU (AVX-512BW/VL/DQ or AVX-NE-CONVERT): without them its reorder
    raises, and bf16 weights stay dense for `F.linear`."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def fastest_cpu_dtype() -> str:
    """'bf16' where this CPU multiplies bf16 natively (the native kernel or oneDNN), else 'fp32': on a CPU
    without either (an AVX2-only AMD Zen 3, say) bf16 products are converted element by element and run
    several times slower than fp32."""
    native = gemm.supported(torch.bfloat16) or (torch.backends.mkldnn.is_available() and _onednn_bf16())
    return "bf16" if native else "fp32"


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [n, in] @ weight.T for a weight from `pack`."""
    if isinstance(weight, gemm.PackedWeight):
        return gemm.gemm(x, weight)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def linear_add(x: torch.Tensor, weight: Weight, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T (a new tensor). With the native kernel or oneDNN the add happens as the
    product is stored, so the residual stream costs no extra pass (in fp32 bit-identical to adding
    afterwards; in bf16 rounded once instead of twice)."""
    if isinstance(weight, gemm.PackedWeight):
        return gemm.gemm(x, weight, residual)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, None, "add")
    return F.linear(x, weight).add_(residual)
