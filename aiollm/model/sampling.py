"""Choosing the next token: greedy, or temperature with top-k / top-p, reproducible with a seed.

`SamplingParams` is what a request carries (frozen, validated once at the edge); `Sampler` turns a
batch of fp32 logits into token ids, each row with its own parameters and its own generator, so a
seeded request gives the same tokens whatever else shares its batch.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiollm.native import fused_ops


@dataclass(frozen=True)
class SamplingParams:
    """How one request's completion is sampled and when it stops."""

    # most tokens to generate
    max_tokens: int = 16
    # 0 means greedy (argmax); otherwise logits are divided by it before sampling
    temperature: float = 0.0
    # keep only the k most likely tokens (0: all)
    top_k: int = 0
    # keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all)
    top_p: float = 1.0
    # seed of this request's own generator (None: drawn from torch's global generator)
    seed: int | None = None
    # strings that end the completion; the text is cut before the first one
    stop: tuple[str, ...] = ()
    # token ids that end the completion, besides the model's end-of-sequence ids
    stop_token_ids: tuple[int, ...] = ()
    # keep generating past the model's end-of-sequence ids (benchmarks: a fixed number of tokens)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an int >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: must be a tuple of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def new_generator(params: SamplingParams) -> torch.Generator | None:
    """The generator of one request: seeded if asked, None for greedy (it draws nothing)."""
    if params.greedy:
        return None
    generator = torch.Generator()
    if params.seed is None:
        generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
    else:
        generator.manual_seed(params.seed)
    return generator


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit of a 1-D row outside the top-k and outside the top-p nucleus."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        outside = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is already full
        logits = logits.clone()
        logits[order[outside]] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Next token of each row of fp32 logits [b, vocab]; row i uses params[i] and generators[i]."""
    if logits.shape[0] != len(params):
        raise ValueError(f"params: {len(params)} given for {logits.shape[0]} rows of logits")
    native = fused_ops.native(logits) and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
    tokens = (fused_ops.argmax(logits) if native else logits.argmax(dim=-1)).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = filter_logits(logits[i].float() / p.temperature, p.top_k, p.top_p)
        tokens[i] = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=generators[i]).item())
    return tokens
