"""The S-part's matrix products: on CPU, oneDNN with each weight packed once at load time.

`F.linear` goes to MKL's sgemm, which re-packs the weight matrix on every call; at decode batch
sizes (a few to a few hundred rows) that copy costs as much as the product. oneDNN with a weight
packed once into its blocked layout skips it. Measured here for all 30 layers of SmolLM2 plus the
lm_head at batch 8: fp32 53 -> 39 ms, bf16 23 -> 17 ms; at batch 64 bf16 34 -> 25 ms. Elsewhere
(CUDA, a torch without oneDNN) weights stay dense and `F.linear` is used.
"""
import torch
import torch.nn.functional as F


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in the fastest layout for `linear` on its device (a oneDNN tensor on CPU)."""
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and \
            weight.dtype in (torch.float32, torch.bfloat16):
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ weight.T for a weight from `pack`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight.T (a new tensor): on CPU the add is a oneDNN post-op of the GEMM, so the
    residual stream costs no extra pass (in fp32 bit-identical to adding afterwards)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, None, "add")
    return F.linear(x, weight).add_(residual)
