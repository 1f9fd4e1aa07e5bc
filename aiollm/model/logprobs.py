"""Log-probabilities of sampled tokens: what a request that asks for `logprobs` gets back per token.

They are the model's own distribution, the log-softmax of the raw fp32 logits, taken before any
logit_bias, penalty, temperature or top-k/top-p/min-p changes them (vLLM's default "raw" logprobs).
They are computed where the token is sampled and travel with it, one compact entry per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

# most alternatives a request may ask for per token (OpenAI's limit)
MAX_TOP_LOGPROBS = 20


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """The sampled token's log-probability and the most likely alternatives."""

    # log-probability of the sampled token
    logprob: float
    # (token id, log-probability) of the most likely tokens, most likely first
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprobs]:
    """One entry per row of raw logits [b, vocab]: the log-probability of tokens[i] and the top_n[i] best."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.int64)[:, None])[:, 0].tolist()
    width = min(max(top_n, default=0), logp.shape[-1])
    if width:
        values, ids = torch.topk(logp, width, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    entries = []
    for i, n in enumerate(top_n):
        top = tuple(zip(ids[i][:n], values[i][:n])) if n and width else ()
        entries.append(TokenLogprobs(chosen[i], top))
    return entries
