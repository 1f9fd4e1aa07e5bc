"""What a request's sampling options do to its row of logits before a token is chosen.

The order is vLLM's: a request with a `response_format` has its row masked to the tokens its grammar
allows (aiollm.model.structured, before the row gets here), then `logit_bias` is added, the stop ids are
masked while fewer than `min_tokens` tokens were generated, then the penalties (repetition over prompt and
output, frequency and presence over the output) — all before greedy's argmax; a sampled row is then divided
by its temperature and filtered by min-p, top-k and top-p (`sampling.filter_logits`). A row none of these
touch never gets here: the sampler keeps its one fast argmax over the batch for them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from aiollm.model.sampling import SamplingParams


@dataclass(frozen=True)
class RowHistory:
    """What the processors need of one row's tokens."""

    # prompt then output token ids (after a resume the prompt ends with tokens generated before it)
    tokens: Sequence[int]
    # how many of the last tokens were generated (the output, counted from the request's first token)
    generated: int
    # the ids that end the sequence (masked until min_tokens are generated)
    stop_ids: frozenset[int] = frozenset()


def process(row: torch.Tensor, p: SamplingParams, history: RowHistory | None) -> torch.Tensor:
    """A new 1-D fp32 row with logit_bias, the min_tokens mask and the penalties applied, in that order."""
    row = row.float().clone()
    vocab = row.shape[0]
    if p.logit_bias:
        pairs = [(t, b) for t, b in p.logit_bias if t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
            row.index_add_(0, ids, torch.tensor([b for _, b in pairs], dtype=row.dtype))
    if not (p.min_tokens or p.penalised):
        return row
    if history is None:
        raise ValueError("history: penalties and min_tokens need each row's tokens")
    if p.min_tokens and history.generated < p.min_tokens:
        stops = [t for t in history.stop_ids if t < vocab]
        if stops:
            kept = row.index_fill(0, torch.tensor(stops, dtype=torch.int64), float("-inf"))
            # a complete JSON output allows only the stop ids: it ends even before min_tokens
            if not p.structured or bool(torch.isfinite(kept).any()):
                row = kept
    tokens = torch.tensor(list(history.tokens), dtype=torch.int64)
    if p.repetition_penalty != 1.0 and len(tokens):
        seen = torch.unique(tokens[tokens < vocab])
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        output = tokens[len(tokens) - min(history.generated, len(tokens)) :]
        counts = torch.bincount(output[output < vocab], minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
