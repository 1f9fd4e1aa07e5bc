"""Rotary position embedding, computed the way transformers' Llama does (so fp32 q/k match it bit for bit),
with its context-extension scalings (linear, dynamic NTK, llama3, yarn).

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
    """The per-pair rotation frequencies [head_dim/2] (fp32), scaled for context extension if asked (transformers'
    formulas; "dynamic" gives the frequencies up to its original context, `dynamic_frequencies` those past it)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if scaling is None or scaling.kind == "dynamic":
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "freq_factors":
        if len(scaling.freq_factors) != inv.shape[0]:
            raise ValueError(f"rope_scaling.freq_factors: need {inv.shape[0]} factors, got {len(scaling.freq_factors)}")
        return inv / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling)
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


def _yarn(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) frequencies below the beta_slow rotations, extrapolated (kept) above
    beta_fast, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def dynamic_frequencies(head_dim: int, theta: float, scaling: RopeScaling, positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK frequencies [n, head_dim/2] of positions past the original context: position p rotates as
    transformers does for a sequence of p + 1 tokens (the base grows with the length)."""
    seq_len = (positions + 1).to(torch.float64)
    orig = scaling.original_max_position
    base = theta * ((scaling.factor * seq_len / orig) - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    return 1.0 / (base.to(torch.float32)[:, None] ** exponents[None, :])


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
        scaling = config.rope_scaling
        inv = inverse_frequencies(config.head_dim, config.rope_theta, scaling)
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]  # == transformers' outer matmul
        if scaling is not None and scaling.kind == "dynamic" and n > scaling.original_max_position:
            past = torch.arange(scaling.original_max_position, n)
            dyn = dynamic_frequencies(config.head_dim, config.rope_theta, scaling, past)
            freqs[scaling.original_max_position :] = past.to(torch.float32)[:, None] * dyn
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = 1.0 if scaling is None else scaling.cos_sin_scale
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:  # yarn: cos and sin scaled as transformers scales them, before the dtype cast
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(device=device, dtype=dtype)
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
