"""Rotary position embedding, computed the way transformers' Llama does (so q/k match it bit for bit).

The cos/sin table is built once up to the model's context length; a step only gathers rows.
"""
import math

import torch

from aiollm.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The per-pair rotation frequencies [head_dim/2] (fp32), scaled for context extension if asked."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    # llama3: long wavelengths divided by factor, short kept, a smooth blend between
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos and sign-folded sin for every position up to `max_positions`, in the compute dtype.

    `sin` holds [-sin, +sin] over the two halves of a head, so `apply_rotary` needs only a roll of x
    instead of rotate_half's slice, negate and concatenate (negation is exact: the products are
    bit-identical to transformers').
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
                 max_positions: int | None = None) -> None:
        n = max_positions or config.max_context
        inv = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]  # == transformers' outer matmul
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        sin = emb.sin()
        sin[:, :inv.shape[0]].neg_()
        self.sin = sin.to(device=device, dtype=dtype)

    def __len__(self) -> int:
        return self.cos.shape[0]

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [n, 1, head_dim] for a 1-D tensor of positions, ready to broadcast over heads."""
        if positions.numel() and int(positions.max()) >= len(self):
            raise ValueError(f"positions: {int(positions.max())} is beyond the model context of {len(self)}")
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated: x*cos + rotate_half(x)*sin (HF's half-split convention), with `sin` the
    table's sign-folded sin: rotate_half(x)*sin == roll(x, half)*signed_sin, element for element."""
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(sin)
    return torch.mul(x, cos).add_(rotated)
