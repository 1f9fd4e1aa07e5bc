"""Prefill after a cached prefix: compute only the tokens past it, attending over the prefix's stored K/V.

`LlamaModel.prefill` runs whole prompts. A prompt whose first `start` tokens' K/V already sit in a KV cache
(prefix caching) runs here from position `start` on: the same per-layer S-part calls (RoPE at the tokens' true
positions), and attention of the new tokens over [prefix K/V | their own K/V] with a causal mask shifted by
`start` (token j of the suffix sees positions 0..start + j). Prompts with `start == 0` take
`prefill_attention`, as in a whole prefill. With an fp32 KV cache the logits and the new K/V are the bits a
whole prefill of the prompt gives (tests/unit/test_prefix_prefill.py); a quantised cache hands back its
rounded prefix, which decode attends over too.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from aiollm.model.attention import prefill_attention
from aiollm.model.llama import KVSink, LlamaModel

# (layer, prompt index) -> that prompt's prefix k, v [start, n_kv_heads, head_dim]
PastKV = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def prefill_after(
    model: LlamaModel,
    token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    past: PastKV,
    kv_sink: KVSink | None = None,
) -> torch.Tensor:
    """fp32 logits [n_prompts, vocab] of each prompt's last token. `token_ids[i]` are prompt i's tokens from
    position `starts[i]` on (at least one), `past(layer, i)` the K/V of its first `starts[i]` tokens;
    `kv_sink(layer, k, v)` receives the new tokens' K/V, packed in prompt order."""
    if len(starts) != len(token_ids):
        raise ValueError(f"starts: expected {len(token_ids)} offsets (one per prompt), got {len(starts)}")
    if not token_ids or any(len(ids) == 0 for ids in token_ids) or any(s < 0 for s in starts):
        raise ValueError("token_ids: need at least one prompt, each with at least one token, and starts >= 0")
    lens = [len(ids) for ids in token_ids]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    rope = model.rope(positions)
    h = model.embed([t for ids in token_ids for t in ids])
    for layer in range(model.config.n_layers):
        q, k, v = model.pre_attention(layer, h, positions, rope)
        if kv_sink is not None:
            kv_sink(layer, k, v)
        out = torch.empty_like(q)
        at = 0
        window = model.config.sliding_window
        for i, (start, n) in enumerate(zip(starts, lens)):
            rows = slice(at, at + n)
            if start == 0:
                out[rows] = prefill_attention(q[rows], k[rows], v[rows], [n], window=window)
            else:
                past_k, past_v = past(layer, i)
                out[rows] = _attend_after(q[rows], k[rows], v[rows], past_k, past_v, window)
            at += n
        h = model.post_attention(layer, h, out)
    last = torch.tensor(lens).cumsum(0) - 1
    return model.logits(h[last.to(h.device)])


def _attend_after(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of n new tokens q [n, heads, d] over [past | new] K/V, the new ones at positions start...;
    with `window`, the token at position p sees positions (p - window, p] only."""
    start, n = past_k.shape[0], q.shape[0]
    keys = torch.cat([past_k.to(device=k.device, dtype=k.dtype), k])
    values = torch.cat([past_v.to(device=v.device, dtype=v.dtype), v])
    mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start)
    if window is not None:
        mask &= ~torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(start - window)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)
