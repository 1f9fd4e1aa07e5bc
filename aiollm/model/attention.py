"""The R-part: attention, the only per-sequence work of a step (no weights, reads each sequence's own K/V).

Prefill attends within each prompt of a packed batch with torch SDPA (causal, grouped-query).
Decode writes the new token's K/V into the paged pool and attends over the pool with the native
kernel; the pool is anything with aiollm.kv.pool.KVPool's `write`/`attend`, so an R-worker that
holds its pool in another process calls the same function on its side.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch.

    q [n, n_heads, d], k/v [n, n_kv_heads, d] with n = sum(seq_lens), sequences back to back. `window`: token i
    attends to tokens (i - window, i] only (sliding-window attention), as transformers masks it.
    Returns [n, n_heads, d] in q's dtype.
    """
    if sum(seq_lens) != q.shape[0]:
        raise ValueError(f"seq_lens: they sum to {sum(seq_lens)}, the batch has {q.shape[0]} tokens")
    out = torch.empty_like(q)
    start = 0
    for n, count in _runs(seq_lens):
        end = start + n * count
        mask = None
        if window is not None and n > window:  # causal band: is_causal and an explicit mask are exclusive in SDPA
            i = torch.arange(n, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        # a run of `count` prompts of n tokens: [count * n, heads, d] -> [count, heads, n, d], views (SDPA takes
        # the strides as they are); one call per run instead of per prompt (a batch of 64 equal prompts made
        # 64 calls per layer)
        o = F.scaled_dot_product_attention(
            *(x[start:end].unflatten(0, (count, n)).transpose(1, 2) for x in (q, k, v)),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(1, 2).flatten(0, 1)
        start = end
    return out


def _runs(seq_lens: Sequence[int]) -> list[tuple[int, int]]:
    """(length, count) of each run of consecutive equal lengths, in order."""
    runs: list[tuple[int, int]] = []
    for n in seq_lens:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def paged_decode_attention(
    pool,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping,
    block_tables,
    seq_lens,
    n_threads: int | None = None,
) -> torch.Tensor:
    """One decode step's attention for a batch: store the new K/V, then attend over each sequence's cache.

    q [b, n_heads, d], k/v [b, n_kv_heads, d] (one new token per sequence); slot_mapping int [b] (where the
    new token's K/V goes); block_tables int32 [b, max_blocks]; seq_lens int32 [b] including the new token;
    the three index arrays as numpy arrays or torch CPU tensors.
    Returns [b, n_heads, d] in q's dtype when it is fp32 or bf16 (the kernel writes it directly), else fp32.
    A loop over layers should prepare the step once instead: `step_decode_attention`.
    """
    step = pool.prepare_decode(slot_mapping, block_tables, seq_lens)
    return step_decode_attention(step, layer, q, k, v, n_threads=n_threads)


def step_decode_attention(
    step,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
    n_threads: int | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` with the step's index arrays checked once (`KVPool.prepare_decode`).

    `out` (optional) is reused across layers: a step allocates it once; its dtype is q's when that is fp32
    or bf16, else fp32, and its shape q's.
    """
    step.write(layer, k, v)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32)
    return step.attend(layer, q.float(), out, n_threads=n_threads)
