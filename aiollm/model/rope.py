"""Rotary position embedding, computed the way transformers' Llama does (so fp32 q/k match it bit for bit).

The cos/sin table is built once up to the model's context length. A step's `Rotation` (its positions,
checked once) rotates every layer's q and k: on CPU in fp32/bf16 with the native kernel, which reads
the table rows itself (no gathered copies), writes q where the caller wants it (e.g. the fp32 buffer
decode attention reads) and k in place; elsewhere with `apply_rotary`.
"""

import math

import torch

from aiollm.model.config import ModelConfig, RopeScaling
from aiollm.native import fused_ops


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
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos and sign-folded sin for every position up to `max_positions`, in the compute dtype.

    `sin` holds [-sin, +sin] over the two halves of a head, so `apply_rotary` needs only a roll of x
    instead of rotate_half's slice, negate and concatenate (negation is exact: the products are
    bit-identical to transformers').
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        max_positions: int | None = None,
    ) -> None:
        n = max_positions or config.max_context
        inv = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]  # == transformers' outer matmul
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        sin = emb.sin()
        sin[:, : inv.shape[0]].neg_()
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


class Rotation:
    """One step's RoPE: the tokens' positions (int64 [n], checked against the table once) and the table."""

    def __init__(self, table: RotaryTable, positions: torch.Tensor) -> None:
        self.positions = positions.to(dtype=torch.int64, device=table.cos.device).contiguous()
        self.table = table
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.positions.numel() and (int(self.positions.min()) < 0 or int(self.positions.max()) >= len(table)):
            raise ValueError(
                f"positions: expected positions in [0, {len(table)}) (the model context), got "
                f"{int(self.positions.min())}..{int(self.positions.max())}"
            )

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [n, 1, head_dim] of these positions (gathered once, for `apply_rotary`)."""
        if self._gathered is None:
            self._gathered = self.table.gather(self.positions)
        return self._gathered

    def rotate_qk(
        self, qkv: torch.Tensor, n_q_heads: int, n_kv_heads: int, q_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate the q and k heads of qkv [n, heads, head_dim] (q heads first, then k, then anything): k in
        place, q into q_out [n, n_q_heads, head_dim] (fp32 or qkv's dtype; None: in place). Returns q."""
        n, _, d = qkv.shape
        if fused_ops.native(qkv) and qkv.dtype == self.table.cos.dtype and qkv.stride(2) == 1 and qkv.stride(1) == d:
            rows = qkv.flatten(1)  # a view (heads and dims are contiguous): rotating it rotates qkv
            flat_out = None if q_out is None else q_out.view(n, n_q_heads * d)
            fused_ops.rope_qk(rows, self.positions, self.table.cos, self.table.sin, n_q_heads, n_kv_heads, flat_out)
            return qkv[:, :n_q_heads] if q_out is None else q_out
        qk = apply_rotary(qkv[:, : n_q_heads + n_kv_heads], *self.gathered())
        qkv[:, n_q_heads : n_q_heads + n_kv_heads] = qk[:, n_q_heads:]
        if q_out is None:
            qkv[:, :n_q_heads] = qk[:, :n_q_heads]
            return qkv[:, :n_q_heads]
        q_out.copy_(qk[:, :n_q_heads])
        return q_out
